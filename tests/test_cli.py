"""The command-line tool and the report record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
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
        assert lines[1:] == [f"CUDA: not available: {reason.removeprefix('CUDA is not available: ')}"]
        assert lines[1].count("not available") == 1
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


def _stage_args(preset: str, stage: str, **given):
    """The command line's parsed arguments with one stage's options set, and blocks with that stage."""
    import argparse

    from ddo_blocks.blocks.runner import STAGES

    ns = argparse.Namespace(preset=preset, **{f"{s}_{k}": None for s in STAGES
                                              for k in ("route", "preset", "budget", "offload_type")})
    for key, value in given.items():
        setattr(ns, f"{stage}_{key}", value)
    return ns, argparse.Namespace(sub_blocks={stage: None})


@pytest.mark.parametrize("budget", ["min", "auto"])
def test_budget_min_and_auto_are_for_the_routes_that_stream(budget):
    from ddo_blocks.blocks.runner import stage_policies

    ns, blocks = _stage_args("off", "text_encoder", route="resident", budget=budget)
    with pytest.raises(ddo_blocks.ConfigError, match=f"budget {budget} applies to the routes that stream "
                                                      "\\(linear, nvme, sdnq, vmm\\); route 'resident' was asked"):
        stage_policies(ns, {}, blocks)


def test_budget_auto_on_the_command_line_reaches_the_policy():
    from ddo_blocks.blocks.policy import OffloadPolicy
    from ddo_blocks.blocks.runner import stage_policies

    ns, blocks = _stage_args("auto", "denoise", route="linear", budget="auto")
    policy = OffloadPolicy.parse(stage_policies(ns, {}, blocks)["denoise"])
    assert policy.vram_budget == "auto" and policy.offload_kwargs()["vram_budget"] == "auto"
    assert "budget auto" in policy.describe()


def test_a_model_of_another_family_is_named(tmp_path):
    import pytest

    from ddo_blocks.blocks.runner import check_model_family

    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    with pytest.raises(ddo_blocks.ConfigError, match="holds a StableDiffusion3Pipeline .* runs a FluxPipeline .* "
                                                      "pipelines/sd3_t2i.py"):
        check_model_family(tmp_path, "flux")
    check_model_family(tmp_path, "sd3")
    with pytest.raises(ddo_blocks.ConfigError, match="no model_index.json"):
        check_model_family(tmp_path / "missing", "wan")


def test_offload_type_block_level_on_the_command_line_works():
    from ddo_blocks.blocks.policy import OffloadPolicy
    from ddo_blocks.blocks.runner import stage_policies

    ns, blocks = _stage_args("auto", "decode", route="diffusers", offload_type="block_level")
    policy = OffloadPolicy.parse(stage_policies(ns, {}, blocks)["decode"])
    policy.check(torch.device("cpu"))  # block_level with its num_blocks_per_group: valid
    assert policy.options["num_blocks_per_group"] == 1


def test_from_pretrained_names_dtype_when_given_torch_dtype(flux_checkpoints):
    import pytest
    from diffusers import FluxTransformer2DModel

    with pytest.raises(ddo_blocks.ConfigError, match="takes dtype=, not torch_dtype="):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, flux_checkpoints[0] / "single", device="cpu",
                                   torch_dtype=torch.bfloat16)


def test_preset_vmm_fast_on_the_command_line_needs_a_budget_and_cuda():
    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ddo_blocks", "run", "--preset", "vmm_fast", "--device", "cpu",
                               *extra], capture_output=True, text=True)

    out = run()
    assert out.returncode != 0 and "--preset vmm_fast shares one VRAM budget" in out.stderr + out.stdout
    out = run("--vram-budget", "1GiB")
    assert out.returncode != 0 and "route='vmm'" in out.stderr + out.stdout and "needs a CUDA device" in (
        out.stderr + out.stdout)


def test_graph_on_the_command_line_reaches_the_policy():
    from ddo_blocks.blocks.policy import OffloadPolicy
    from ddo_blocks.blocks.runner import stage_policies

    ns, blocks = _stage_args("auto", "denoise", route="linear", graph=True)
    policy = OffloadPolicy.parse(stage_policies(ns, {}, blocks)["denoise"])
    assert policy.options["graph"] is True and "graph=True" in policy.describe()
    assert "--denoise-graph" in _run_help()


def _run_help() -> str:
    import argparse

    from ddo_blocks import mainjob

    p = argparse.ArgumentParser()
    mainjob.add_arguments(p)
    return p.format_help()


def test_run_without_transformers_names_the_extra(monkeypatch, capsys):
    """After a plain wheel install (no transformers), `ddo run` says what to install instead of a raw
    ModuleNotFoundError."""
    import importlib.util

    from ddo_blocks.__main__ import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert main(["run"]) == 2
    assert "pip install 'ddo-blocks[pipelines]'" in capsys.readouterr().err
