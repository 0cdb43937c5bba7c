"""The staged pipelines in pipelines/ and the main job (`make run`) on the embedded tiny models, on
the CPU: each runs offline, prints each block's report, writes its output and report JSON, and gives
the output of the same pipeline without offloading."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from ddo_blocks.__main__ import main as ddo_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def cache(monkeypatch):
    monkeypatch.setenv("DDO_CACHE_DIR", str(ROOT / ".ddo_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _script(name: str):
    monkey_path = str(ROOT / "pipelines")
    if monkey_path not in sys.path:
        sys.path.insert(0, monkey_path)
    spec = importlib.util.spec_from_file_location(f"ddo_pipeline_{name}", ROOT / "pipelines" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, family, output", [
    ("flux_t2i", "flux", "image.png"),
    ("sd3_t2i", "sd3", "image.png"),
    ("wan_t2v", "wan", "video.gif"),
])
def test_modular_pipelines_run_exactly(name, family, output, tmp_path, capsys):
    rc = _script(name).main(["--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "output equals the same pipeline without offloading: yes" in out
    assert (tmp_path / output).is_file()
    record = json.loads((tmp_path / f"report_{family}.json").read_text())
    assert record["exact"] is True and record["tiny"] is True
    assert {"text_encoder", "denoise", "decode"} <= set(record["stages"])
    assert str((tmp_path / output).resolve()) in out


def test_staged_script_matches_the_one_piece_pipeline(tmp_path, capsys):
    from diffusers.modular_pipelines import FluxAutoBlocks

    from ddo_blocks.blocks.runner import minimum_budget
    from ddo_blocks.tiny_pipeline import CALL_DEFAULTS, ensure_tiny_model, load_components

    staged = _script("flux_staged")
    comps = load_components(ensure_tiny_model("flux"))
    plain = FluxAutoBlocks().init_pipeline()
    plain.update_components(**comps)
    ref = plain(prompt="a cat", generator=torch.Generator().manual_seed(5), output_type="pt",
                **CALL_DEFAULTS["flux"]).get("images")
    blocks = staged.stages("cpu", encoder="resident",
                           transformer={"route": "linear", "vram_budget": minimum_budget(comps["transformer"])},
                           vae={"route": "diffusers", "offload_type": "leaf_level"})
    images, reports = staged.generate(comps, blocks, prompt="a cat", seed=5, **CALL_DEFAULTS["flux"])
    assert torch.equal(images, ref)
    assert set(reports) == {"text_encoder", "denoise", "decode"}
    assert reports["decode"]["vae"]["route"] == "diffusers"
    rc = staged.main(["--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    assert (tmp_path / "image_staged.png").is_file() and (tmp_path / "report_flux_staged.json").is_file()


def test_main_job(tmp_path, capsys):
    rc = ddo_main(["run", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for line in ("[text_encoder] text_encoder", "[text_encoder] text_encoder_2", "[denoise] transformer",
                 "[decode] vae", "output equals the same pipeline without offloading: yes",
                 f"images written to {(tmp_path / 'image.png').resolve()}",
                 f"report written to {(tmp_path / 'report_flux.json').resolve()}"):
        assert line in out
    record = json.loads((tmp_path / "report_flux.json").read_text())
    stages = record["stages"]
    assert stages["text_encoder"]["text_encoder"]["plan"]["offload_type"] == "leaf_level"
    tr = stages["denoise"]["transformer"]
    assert tr["route"] == "linear" and tr["plan"]["streamed_units"] > 1
    assert tr["plan"]["gpu_bytes"] <= tr["plan"]["vram_budget"]
    assert stages["decode"]["vae"]["route"] == "resident"


def test_main_job_routes_per_stage(tmp_path, capsys):
    rc = ddo_main(["run", "--device", "cpu", "--out", str(tmp_path), "--text-encoder-route", "resident",
                   "--denoise-route", "diffusers", "--denoise-preset", "diffusers_offload_compat",
                   "--decode-route", "linear", "--decode-budget", "min", "--no-check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    stages = json.loads((tmp_path / "report_flux.json").read_text())["stages"]
    assert stages["text_encoder"]["text_encoder"]["route"] == "resident"
    assert stages["denoise"]["transformer"]["plan"]["offload_type"] == "block_level"
    assert stages["decode"]["vae"]["route"] == "linear"


def test_main_job_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        ddo_main(["run", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model PATH", "--device", "--denoise-route", "--denoise-preset", "--denoise-budget",
                 "--text-encoder-route", "--decode-route"):
        assert flag in text
    rc = ddo_main(["run", "--device", "cpu", "--out", str(tmp_path), "--denoise-route", "diffusers",
                   "--denoise-budget", "1GiB"])
    assert rc == 2
    assert "takes no vram_budget" in capsys.readouterr().err
    rc = ddo_main(["run", "--device", "cpu", "--model", str(tmp_path)])
    assert rc == 2
    assert "no model_index.json" in capsys.readouterr().err
