"""The blocks as published custom blocks: ``pipelines/<name>/block.py`` + ``modular_config.json``,
loaded offline with ``ModularPipelineBlocks.from_pretrained(dir, trust_remote_code=True)``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers.modular_pipelines import FluxAutoBlocks, ModularPipelineBlocks

from ddo_blocks.blocks import REPORTS_KEY, OffloadBlock, remove_offload
from ddo_blocks.tiny_pipeline import CALL_DEFAULTS, ensure_tiny_model, load_components

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ("ddo_flux", "ddo_offload")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))


@pytest.mark.parametrize("name", PUBLISHED)
def test_layout(name):
    folder = ROOT / "pipelines" / name
    config = json.loads((folder / "modular_config.json").read_text())
    module, cls = config["auto_map"]["ModularPipelineBlocks"].split(".")
    assert (folder / f"{module}.py").is_file()
    assert config["_class_name"] == cls
    assert f"class {cls}(" in (folder / f"{module}.py").read_text()


def test_flux_blocks_load_offline_and_run_exactly():
    flux_dir = ensure_tiny_model("flux", ROOT / ".ddo_cache")
    blocks = ModularPipelineBlocks.from_pretrained(str(ROOT / "pipelines" / "ddo_flux"), trust_remote_code=True,
                                                   device="cpu", decode="resident",
                                                   denoise={"route": "linear", "vram_budget": "400KiB"})
    assert type(blocks).__name__ == "DdoFluxAutoBlocks"
    assert isinstance(blocks, FluxAutoBlocks)
    assert all(isinstance(b, OffloadBlock) for b in blocks.sub_blocks.values())
    assert blocks.sub_blocks["decode"].component_policies["vae"].route == "resident"
    comps = load_components(flux_dir)
    plain = FluxAutoBlocks().init_pipeline()
    plain.update_components(**comps)
    pipe = blocks.init_pipeline()
    pipe.update_components(**comps)
    call = dict(prompt="a red fox", output_type="pt", **CALL_DEFAULTS["flux"])
    ref = plain(generator=torch.Generator().manual_seed(3), **call).get("images")
    state = pipe(generator=torch.Generator().manual_seed(3), **call)
    assert torch.equal(state.get("images"), ref)
    assert state.get(REPORTS_KEY)["denoise"]["transformer"]["plan"]["vram_budget"] == 400 * 1024
    remove_offload(pipe)


def test_offload_block_loads_offline_with_its_stage():
    block = ModularPipelineBlocks.from_pretrained(
        str(ROOT / "pipelines" / "ddo_offload"), trust_remote_code=True,
        block=FluxAutoBlocks().sub_blocks["denoise"], stage="denoise", policy="resident", device="cpu",
    )
    assert type(block).__name__ == "DdoOffloadBlock" and isinstance(block, OffloadBlock)
    assert block.component_policies["transformer"].route == "resident"
    assert block.model_name == "flux"


def test_loading_needs_trust_remote_code():
    with pytest.raises(ValueError):
        ModularPipelineBlocks.from_pretrained(str(ROOT / "pipelines" / "ddo_flux"), trust_remote_code=False)
