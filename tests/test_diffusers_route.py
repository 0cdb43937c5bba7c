"""The Diffusers compatibility route (``route="diffusers"``): official group offloading applied through
``ddo_blocks.offload``, checked up front, removed cleanly. On the CPU (onload device = cpu, no streams)."""

from __future__ import annotations

import copy

import pytest
import torch

import ddo_blocks
from ddo_blocks import ConfigError, OffloadStateError
from ddo_blocks.presets import ROUTES, describe, resolve
from ddo_blocks.tiny import flux_inputs

from .helpers import assert_restored, snapshot


def _group_offloaded(module) -> bool:
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    return _is_group_offload_enabled(module)


def _no_hooks_left(module) -> None:
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        if registry is not None:
            for name in ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading"):
                assert registry.get_hook(name) is None, f"{name} left on {type(sub).__name__}"


def test_presets_registered():
    assert set(ROUTES["diffusers"]) == {"diffusers_offload_compat", "diffusers_leaf_offload_compat"}
    assert resolve("diffusers", "auto").name == "diffusers_offload_compat"
    table = describe()
    assert "diffusers_leaf_offload_compat" in table and "diffusers_offload_compat" in table


@pytest.mark.parametrize(
    "preset, options",
    [
        ("diffusers_offload_compat", {}),
        ("diffusers_offload_compat", {"num_blocks_per_group": 2}),
        ("diffusers_leaf_offload_compat", {}),
        ("diffusers_leaf_offload_compat", {"offload_type": "block_level", "num_blocks_per_group": 1}),
    ],
)
def test_exact_and_restored(flux, preset, options):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    snap = snapshot(flux)
    handle = ddo_blocks.offload(flux, route="diffusers", preset=preset, device="cpu", component="transformer",
                                **options)
    assert _group_offloaded(flux)
    with torch.no_grad():
        outs = [flux(**x)[0] for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    report = handle.report()
    assert report["route"] == "diffusers" and report["preset"] == preset
    handle.remove()
    assert not _group_offloaded(flux)
    _no_hooks_left(flux)
    assert_restored(flux, snap)
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)


def test_transformers_encoder_uses_apply_group_offloading():
    from ddo_blocks.tiny_pipeline import _t5

    enc = _t5(seed=0)
    ids = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        ref = enc(ids).last_hidden_state
    snap = snapshot(enc)
    assert not hasattr(enc, "enable_group_offload")
    with ddo_blocks.offload(enc, route="diffusers", preset="diffusers_leaf_offload_compat", device="cpu"):
        assert _group_offloaded(enc)
        with torch.no_grad():
            assert torch.equal(enc(ids).last_hidden_state, ref)
    _no_hooks_left(enc)
    assert_restored(enc, snap)


def test_vae_decode_goes_through_the_groups(vae):
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = vae.decode(z).sample
    with ddo_blocks.offload(vae, route="diffusers", preset="diffusers_offload_compat", device="cpu"), torch.no_grad():
        assert torch.equal(vae.decode(z).sample, ref)


def _diffusers_disk_result(model, inputs, folder):
    """The output of diffusers' own disk offload (no ddo_blocks) of a copy of ``model`` on this machine.

    Its parameters are read back from its files at the files' offsets, not at addresses PyTorch's
    allocator would give (``data_ptr % 64`` of 8, 40, 56 seen), and on some CPUs (AMD EPYC) the
    kernels then take another path: the output differs from the resident one in the last bits.
    "As Diffusers" means this result, not the resident one."""
    from diffusers.hooks import apply_group_offloading

    twin = copy.deepcopy(model)
    apply_group_offloading(twin, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=False,
                           offload_to_disk_path=str(folder))
    with torch.no_grad():
        return twin(**inputs)[0]


def test_disk_offload_uses_a_fresh_folder_and_cleans_it(flux, tmp_path):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    theirs = _diffusers_disk_result(flux, x, tmp_path / "theirs")
    snap = snapshot(flux)
    ours = tmp_path / "ours"
    ours.mkdir()
    stale = ours / "group_stale.safetensors"
    stale.write_bytes(b"not a safetensors file")  # a stale file of another run must never be read
    handle = ddo_blocks.offload(flux, route="diffusers", preset="diffusers_offload_compat", device="cpu",
                                offload_to_disk_path=str(ours))
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], theirs)
    sub = [p for p in ours.iterdir() if p.is_dir()]
    assert len(sub) == 1 and any(f.suffix == ".safetensors" for f in sub[0].iterdir())
    handle.remove()
    assert [p.name for p in ours.iterdir()] == ["group_stale.safetensors"]
    assert_restored(flux, snap)
    # restored into memory from PyTorch's allocator: bit-identical to the resident run again
    misaligned = [n for n, p in flux.named_parameters() if p.data_ptr() % 64]
    assert not misaligned, misaligned
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)


@pytest.mark.parametrize(
    "preset, options, match",
    [
        ("diffusers_leaf_offload_compat", {"offload_type": "block_level"}, "needs num_blocks_per_group"),
        ("diffusers_offload_compat", {"record_stream": True}, "record_stream=True needs use_stream=True"),
        ("diffusers_offload_compat", {"use_stream": True}, "needs a CUDA device"),
        ("diffusers_leaf_offload_compat", {"num_blocks_per_group": 2}, "only applies to offload_type='block_level'"),
        ("diffusers_offload_compat", {"offload_type": "layer"}, "use 'block_level' or 'leaf_level'"),
        ("diffusers_offload_compat", {"num_blocks_per_group": 0}, "must be a positive int"),
        ("diffusers_offload_compat", {"pin_groups": "all"}, "its options are offload_type"),
        ("diffusers_offload_compat", {"use_stream": "yes"}, "must be True or False"),
    ],
)
def test_bad_options_fail_before_anything_moves(flux, preset, options, match):
    snap = snapshot(flux)
    with pytest.raises(ConfigError, match=match):
        ddo_blocks.offload(flux, route="diffusers", preset=preset, device="cpu", **options)
    assert not _group_offloaded(flux)
    assert ddo_blocks.get_handle(flux) is None
    assert_restored(flux, snap)


def test_budget_is_refused(flux):
    with pytest.raises(ConfigError, match="takes no vram_budget.*route='linear'"):
        ddo_blocks.offload(flux, route="diffusers", vram_budget="1GiB", device="cpu")


def test_unsupported_class_says_what_would_work(vae, monkeypatch):
    monkeypatch.setattr(type(vae), "_supports_group_offloading", False)
    snap = snapshot(vae)
    with pytest.raises(ConfigError, match="does not support diffusers group offloading.*route='linear'"):
        ddo_blocks.offload(vae, route="diffusers", device="cpu")
    assert_restored(vae, snap)


def test_existing_group_offloading_is_a_conflict(flux):
    flux.enable_group_offload(onload_device="cpu", offload_type="leaf_level")
    with pytest.raises(OffloadStateError, match="already has diffusers group offloading"):
        ddo_blocks.offload(flux, route="diffusers", device="cpu")
    assert _group_offloaded(flux)  # the caller's offloading is left as it was


def test_accelerate_hook_is_a_conflict(flux):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(flux.transformer_blocks[0], AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(OffloadStateError, match="accelerate hook on transformer_blocks.0"):
        ddo_blocks.offload(flux, route="diffusers", device="cpu")


def test_missing_accelerate_is_explained(flux, monkeypatch):
    import diffusers.utils

    monkeypatch.setattr(diffusers.utils, "is_accelerate_available", lambda: False)
    with pytest.raises(ConfigError, match="needs accelerate"):
        ddo_blocks.offload(flux, route="diffusers", device="cpu")


def test_offload_twice_is_refused(flux):
    with ddo_blocks.offload(flux, route="diffusers", device="cpu"), pytest.raises(OffloadStateError):
        ddo_blocks.offload(flux, route="diffusers", device="cpu")


@pytest.mark.gpu
def test_streams_on_cuda_exact_and_restored(flux):
    x = flux_inputs(flux, device="cuda")
    flux.to("cuda")
    with torch.no_grad():
        ref = flux(**x)[0]
    flux.to("cpu")
    snap = snapshot(flux)
    for preset in ("diffusers_offload_compat", "diffusers_leaf_offload_compat"):
        with ddo_blocks.offload(flux, route="diffusers", preset=preset, device="cuda") as h:
            assert h.report()["plan"]["use_stream"] is True
            with torch.no_grad():
                outs = [flux(**x)[0] for _ in range(2)]
            assert all(torch.equal(o, ref) for o in outs)
        assert_restored(flux, snap)
        assert not any(p.is_pinned() for p in flux.parameters())


def test_streams_are_off_on_a_device_that_is_not_the_current_one(monkeypatch):
    """diffusers makes its copy stream and synchronizes on the current CUDA device: on cuda:1 beside a
    current cuda:0 its copies would not overlap and every offload would wait for cuda:0, so streams are
    off by default there and refused when asked; on the current device they stay on by default."""
    from ddo_blocks.routes.diffusers import check_options

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert check_options("diffusers_leaf_offload_compat", {}, cuda0).use_stream
    assert not check_options("diffusers_leaf_offload_compat", {}, cuda1).use_stream
    assert not check_options("diffusers_offload_compat", {}, cuda1).use_stream
    with pytest.raises(ConfigError, match=r"use_stream=True on cuda:1.*current CUDA device \(cuda:0\).*set_device"):
        check_options("diffusers_leaf_offload_compat", {"use_stream": True}, cuda1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # cuda:1 made current
    assert check_options("diffusers_leaf_offload_compat", {"use_stream": True}, cuda1).use_stream
    assert not check_options("diffusers_leaf_offload_compat", {}, cuda0).use_stream
