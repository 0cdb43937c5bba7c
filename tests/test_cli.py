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


def test_doctor_runs():
    out = subprocess.run([sys.executable, "-m", "ddo_blocks", "doctor"], capture_output=True, text=True, check=True)
    assert "CUDA" in out.stdout


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
