"""The command-line tool and the report record."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import ddo_blocks
from ddo_blocks.tiny import flux_inputs

from .helpers import budgets


def test_presets_command_lists_every_preset():
    out = subprocess.run([sys.executable, "-m", "ddo_blocks", "presets"], capture_output=True, text=True, check=True)
    for name in ("one_shot_fast", "low_ram_safe", "warm_process", "wsl_compat", "auto", "off", "resident"):
        assert name in out.stdout


def test_doctor_says_what_this_machine_has():
    import torch

    from ddo_blocks import _native

    out = subprocess.run([sys.executable, "-m", "ddo_blocks", "doctor"], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == f"ddo_blocks {ddo_blocks.__version__}, torch {torch.__version__}"
    reason = _native.cuda_unavailable_reason()
    if reason is not None:
        assert lines[1:] == [f"CUDA: not available ({reason})"]
    else:
        assert lines[1] == f"CUDA driver {_native.cuda_driver_version()}, {_native.cuda_device_count()} device(s)"
        if torch.cuda.is_available():
            assert lines[2].startswith(f"{torch.cuda.get_device_name()}: pinned host->device ")
            assert lines[2].endswith(" GB/s") and float(lines[2].split()[-2]) > 0


def test_report_is_versioned_json_with_a_table(flux):
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["half"], device="cpu", component="transformer",
                                units="block")
    with torch.no_grad():
        flux(**flux_inputs(flux))
        flux(**flux_inputs(flux))
    report = handle.report()
    data = json.loads(report.to_json())
    assert data["schema"] == "ddo_blocks.report/1"
    for section in ("plan", "setup", "runtime", "memory", "roofline"):
        assert section in data
    assert data["runtime"]["calls"] == 2
    assert data["plan"]["streamed_units"] + data["plan"]["resident_units"] == 5
    text = str(report)
    assert "transformer" in text and "streamed_units" in text
    assert "<table>" in report._repr_html_()
    handle.remove()


def test_budget_min_is_for_the_routes_that_stream():
    import argparse

    import pytest

    from ddo_blocks.blocks.runner import STAGES, stage_policies

    ns = argparse.Namespace(preset="off", **{f"{s}_{k}": None for s in STAGES for k in ("route", "preset", "budget",
                                                                                      "offload_type")})
    ns.text_encoder_route, ns.text_encoder_budget = "resident", "min"

    class Blocks:
        sub_blocks = {"text_encoder": None}

    with pytest.raises(ddo_blocks.ConfigError, match="budget min applies to the routes that stream \\(linear, nvme\\); "
                                                      "route 'resident' was asked"):
        stage_policies(ns, {}, Blocks())
