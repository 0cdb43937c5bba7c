"""Fast loading from safetensors: exact weights straight into slabs and slots, sharded checkpoints,
and a clear CheckpointError (naming file and tensor) for every broken checkpoint, before anything
is allocated."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file, save_file

import ddo_blocks

from .helpers import budgets, cuda_reference


@pytest.fixture
def saved(flux_checkpoints):
    return flux_checkpoints


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("preset", ["one_shot_fast", "low_ram_safe", "warm_process"])
def test_loaded_model_equals_saved_model(saved, layout, preset):
    root, model, x, ref = saved
    if layout == "sharded":
        assert (root / "sharded" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root / layout, preset=preset, device="cpu",
                                        vram_budget=budgets(model)["all_streamed"], progress=False, units="block")
    loaded = handle.module
    assert loaded.dtype == torch.bfloat16
    assert handle.setup_bytes_read == sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(loaded(**x)[0], ref)
    assert handle.report()["plan"]["streamed_units"] == 5
    handle.remove()
    ddo_blocks.release_warm_slabs()
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2) and p2.device.type == "cpu"


def test_subfolder_and_other_routes(saved, tmp_path):
    root, _model, x, ref = saved
    for route in ("resident", "off"):
        handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root, subfolder="single", route=route,
                                            device="cpu", progress=False)
        with torch.no_grad():
            assert torch.equal(handle.module(**x)[0], ref)
        handle.remove()


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_file(saved, tmp_path):
    root, *_ = saved
    d = _copy(root / "single", tmp_path / "m")
    f = d / "diffusion_pytorch_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ddo_blocks.CheckpointError, match="diffusion_pytorch_model.safetensors.*truncated"):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False)


def test_missing_shard(saved, tmp_path):
    root, *_ = saved
    d = _copy(root / "sharded", tmp_path / "m")
    (d / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ddo_blocks.CheckpointError, match="shard diffusion_pytorch_model-00002-of-00003.safetensors.*missing"):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False)


def _rewrite(d, fn):
    f = d / "diffusion_pytorch_model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def test_shape_mismatch_names_the_tensor(saved, tmp_path):
    root, *_ = saved
    d = _copy(root / "single", tmp_path / "m")
    _rewrite(d, lambda t: t.__setitem__("proj_out.weight", torch.zeros(3, 3, dtype=torch.bfloat16)))
    with pytest.raises(ddo_blocks.CheckpointError, match=r"'proj_out.weight' has shape \[3, 3\] but the model expects"):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False)


def test_unexpected_and_missing_keys(saved, tmp_path):
    root, *_ = saved
    d = _copy(root / "single", tmp_path / "extra")
    _rewrite(d, lambda t: t.__setitem__("surprise.weight", torch.zeros(2)))
    with pytest.raises(ddo_blocks.CheckpointError, match="does not have: 'surprise.weight'"):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False)
    d = _copy(root / "single", tmp_path / "missing")
    _rewrite(d, lambda t: t.pop("norm_out.linear.bias"))
    with pytest.raises(ddo_blocks.CheckpointError, match="lacks tensors the model needs: 'norm_out.linear.bias'"):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ddo_blocks.CheckpointError, match="is not a directory"):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, tmp_path / "nope", device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ddo_blocks.CheckpointError, match="no safetensors weights"):
        ddo_blocks.from_pretrained(FluxTransformer2DModel, tmp_path, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["one_shot_fast", "low_ram_safe"])
def test_loaded_on_cuda_equals_saved_model(saved, preset):
    """Resident tensors go through the pinned staging pair, streamed ones into pinned slabs."""
    root, model, x, _ = saved
    ref, xc = cuda_reference(model, x)
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root / "sharded", preset=preset, device="cuda",
                                        vram_budget=budgets(model)["half"], progress=False)
    assert handle.report()["plan"]["resident_units"] > 0 and handle.report()["plan"]["streamed_units"] > 0
    with torch.no_grad():
        assert torch.equal(handle.module(**xc)[0], ref)
    handle.remove()


def test_modules_kept_in_float32_stay_float32(tmp_path):
    """As diffusers' own loader: `_keep_in_fp32_modules` (Wan's norms, time embedder...) stay float32."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    model.save_pretrained(tmp_path)
    theirs = WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    handle = ddo_blocks.from_pretrained(WanTransformer3DModel, tmp_path, dtype=torch.bfloat16, device="cpu",
                                        progress=False)
    dtypes = {n: p.dtype for n, p in handle.module.named_parameters()}
    assert {n: p.dtype for n, p in theirs.named_parameters()} == dtypes
    assert torch.float32 in dtypes.values() and torch.bfloat16 in dtypes.values()
    handle.remove()


def test_dtype_comes_from_the_argument_then_the_config_then_the_file(saved, tmp_path):
    import shutil

    root, model, x, ref = saved  # a bf16 checkpoint
    d = tmp_path / "m"
    shutil.copytree(root / "single", d)
    assert FluxTransformer2DModel.load_config(d).get("torch_dtype") is None
    h = ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False)
    assert {p.dtype for p in h.module.parameters()} == {torch.bfloat16}  # the file's
    h.remove()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    h = ddo_blocks.from_pretrained(FluxTransformer2DModel, d, device="cpu", progress=False)
    assert {p.dtype for p in h.module.parameters()} == {torch.float32}  # the config's
    for (n, p1), (_, p2) in zip(model.named_parameters(), h.module.named_parameters()):
        assert torch.equal(p1.float(), p2), n  # the file's bf16 values, widened exactly
    h.remove()
    h = ddo_blocks.from_pretrained(FluxTransformer2DModel, d, dtype=torch.bfloat16, device="cpu", progress=False)
    assert {p.dtype for p in h.module.parameters()} == {torch.bfloat16}  # the argument's
    h.remove()
