"""The NVMe route with a codec: disk units read from a coded side file next to the checkpoint
(``streaming.sidefile``), decoded into the slot; exact against the resident run, fewer bytes read
per call, the side file reused, rewritten when the checkpoint changes, and checked before every
call."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from diffusers import FluxTransformer2DModel

import ddo_blocks
from ddo_blocks.streaming import sidefile

from .helpers import budgets, cuda_reference

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture
def ckpt(flux_checkpoints, tmp_path):
    """A private copy of the single-file checkpoint (side files are written next to it)."""
    root, model, x, ref = flux_checkpoints
    shutil.copytree(root / "single", tmp_path / "single")
    return tmp_path / "single", model, x, ref


def _load(path, model, codec, ram_budget=0, device="cpu", units="block", **kw):
    # on a GPU the coded reads' staging buffer is taken from the budget
    budget = kw.pop("vram_budget", budgets(model)["all_streamed"] + sidefile.reserve_bytes(model, codec, torch.device(device)))
    return ddo_blocks.from_pretrained(FluxTransformer2DModel, path, route="nvme", ram_budget=ram_budget, device=device,
                                      vram_budget=budget, progress=False, units=units, codec=codec, **kw)


def _run(handle, x, ref, calls=3):
    for _ in range(calls):
        with torch.no_grad():
            assert torch.equal(handle.module(**x)[0], ref)


def _plain_disk_bytes(path, model):
    h = _load(path, model, "off")
    try:
        return h.report()["plan"]["disk_bytes"]
    finally:
        h.remove()


@pytest.mark.parametrize("codec", ["fixed", "tiered", "huffman", "lossless"])
def test_exact_with_fewer_bytes_from_disk_and_the_side_file_reused(ckpt, codec):
    path, model, x, ref = ckpt
    plain = _plain_disk_bytes(path, model)
    for attach in ("writes", "reuses"):
        handle = _load(path, model, codec)
        _run(handle, x, ref)
        rep = handle.report()
        sec = rep["codec"]
        assert sec["requested"] == codec and sec["codec"] == ("huffman" if codec == "lossless" else codec)
        assert sec["side_file_reused"] is (attach == "reuses")
        assert (sec["encode_s"] > 0) is (attach == "writes")
        assert sec["coded_units"] == rep["plan"]["disk_units"] == 5 and sec["disk_units_read_as_stored"] == 0
        assert sec["raw_bytes"] == plain and sec["coded_bytes"] == rep["plan"]["disk_bytes"] < 0.9 * plain
        assert sec["side_file"].startswith(str(path)) and os.path.getsize(sec["side_file"]) >= sec["side_file_bytes"]
        # what the reader read per call: the coded bytes (aligned), not the checkpoint's
        assert sec["coded_bytes"] <= rep["runtime"]["disk_call_bytes"] < plain
        handle.remove()
        with torch.no_grad():
            assert torch.equal(handle.module(**x)[0], ref)  # read back from the checkpoint, a plain module


def test_one_side_file_serves_every_plan(ckpt):
    """The side file codes tensors, not units: another RAM cache, budget or granularity reuses it."""
    path, model, x, ref = ckpt
    streamed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "blocks." in n)
    _load(path, model, "fixed").remove()  # writes it
    for kw in ({"ram_budget": streamed // 2}, {"units": "child"}):
        handle = _load(path, model, "fixed", **kw)
        _run(handle, x, ref)
        rep = handle.report()
        sec = rep["codec"]
        assert sec["side_file_reused"] is True
        assert sec["coded_units"] == rep["plan"]["disk_units"] > 0
        if "ram_budget" in kw:
            # the RAM cache holds its units coded too: more of them fit the same budget
            plan = rep["plan"]
            assert 0 < plan["cached_units"] == sec["cached_coded_units"] < 5
            assert plan["cached_bytes"] == sec["cached_coded_bytes"] <= kw["ram_budget"]
            e = handle.engine
            raw = sum(e.unit_bytes[e.streamed[u].index] for u in e.store._host_coded)
            assert plan["cached_bytes"] < 0.9 * raw
        handle.remove()


def test_a_changed_checkpoint_codes_again(ckpt):
    path, model, x, ref = ckpt
    _load(path, model, "fixed").remove()
    st = os.stat(path / WEIGHTS)
    os.utime(path / WEIGHTS, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, another identity
    handle = _load(path, model, "fixed")
    assert handle.report()["codec"]["side_file_reused"] is False
    _run(handle, x, ref, calls=1)
    handle.remove()


def test_a_corrupt_header_codes_again(ckpt):
    path, model, x, ref = ckpt
    _load(path, model, "tiered").remove()
    _, header = sidefile.paths(path, "diffusion_pytorch_model", "tiered")
    header.write_text("{not json")
    handle = _load(path, model, "tiered")
    assert handle.report()["codec"]["side_file_reused"] is False
    _run(handle, x, ref, calls=1)
    handle.remove()


def test_a_side_file_changed_while_offloaded_stops_the_call(ckpt):
    path, model, x, ref = ckpt
    handle = _load(path, model, "fixed")
    _run(handle, x, ref, calls=1)
    data, _ = sidefile.paths(path, "diffusion_pytorch_model", "fixed")
    with open(data, "r+b") as f:  # same size, new bytes: a decode of them would be wrong values
        f.write(b"\0" * 64)
    with pytest.raises(ddo_blocks.CheckpointError, match="coded side file .* changed on disk"), torch.no_grad():
        handle.module(**x)
    handle.remove()  # the weights come back from the checkpoint, which did not change
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)


def test_codec_dir_puts_the_side_file_elsewhere(ckpt, tmp_path):
    path, model, x, ref = ckpt
    elsewhere = tmp_path / "side"
    elsewhere.mkdir()
    handle = _load(path, model, "fixed", codec_dir=str(elsewhere))
    _run(handle, x, ref, calls=1)
    assert handle.report()["codec"]["side_file"].startswith(str(elsewhere))
    assert not list(path.glob("*.ddo-*"))
    handle.remove()


def test_a_checkpoint_directory_it_cannot_write_says_to_pass_codec_dir(ckpt):
    path, model, _, _ = ckpt
    data, _ = sidefile.paths(path, "diffusion_pytorch_model", "fixed")
    blocker = data.with_name(f"{data.name}.tmp-{os.getpid()}")
    blocker.mkdir()  # the side file cannot be created (as a read-only directory, also when running as root)
    with pytest.raises(ddo_blocks.ConfigError, match="is not writable.*codec_dir="):
        _load(path, model, "fixed")
    blocker.rmdir()
    assert not list(path.glob("*.ddo-*"))


def test_a_checkpoint_without_bf16_weights_refuses_a_codec(tmp_path):
    from ddo_blocks.tiny import tiny_flux_transformer

    model = tiny_flux_transformer(dtype=torch.float32)
    model.save_pretrained(tmp_path / "fp32")
    with pytest.raises(ddo_blocks.ConfigError, match="codes bf16 weights.*float32"):
        _load(tmp_path / "fp32", model, "fixed")
    assert not list((tmp_path / "fp32").glob("*.ddo-*"))


def test_bad_codec_options(ckpt, tmp_path):
    path, model, _, _ = ckpt
    with pytest.raises(ddo_blocks.ConfigError, match="not a codec of route='nvme'"):
        _load(path, model, "zstd")
    with pytest.raises(ddo_blocks.ConfigError, match="codec_dir=.* is not a directory"):
        _load(path, model, "fixed", codec_dir=str(tmp_path / "missing"))


@pytest.mark.parametrize("codec", ["fixed", "tiered", "huffman"])
def test_the_staging_reserve_holds_every_coded_unit(ckpt, codec):
    """The device staging buffer the budget reserves (estimated before the side file is read) holds
    each unit's blobs as the side file lays them out, padding included: a unit that does not fit is
    read as stored (the GPU run of 9249e0f read two of five that way)."""
    path, model, _, _ = ckpt
    handle = _load(path, model, codec)
    reserve = sidefile.reserve_bytes(model, codec, torch.device("cuda"))
    staged = [layout.nbytes for layout, _ in handle.engine.store._side_unit.values()]
    assert len(staged) == 5 and max(staged) <= reserve
    handle.remove()


@pytest.mark.gpu
@pytest.mark.parametrize("codec,budget,ram", [("fixed", None, 0), ("tiered", None, 0), ("huffman", None, 0),
                                              ("lossless", "min", 0), ("tiered", None, "half")])
def test_cuda_exact_from_the_side_file(ckpt, codec, budget, ram):
    """On the GPU: coded reads through the pinned ring into the device staging buffer, decoded on the
    copy stream, and a RAM cache of coded units; exact, and the staging buffer inside the budget's
    reserve (``"min"`` included)."""
    path, model, x, _ = ckpt
    ref, xc = cuda_reference(model, x)
    streamed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "blocks." in n)
    ram_budget = streamed // 2 if ram == "half" else 0
    handle = _load(path, model, codec, device="cuda", ram_budget=ram_budget, **({"vram_budget": budget} if budget else {}))
    _run(handle, xc, ref)
    sec = handle.report()["codec"]
    assert sec["coded_units"] + sec["cached_coded_units"] == 5
    assert (sec["cached_coded_units"] > 0) is (ram == "half")
    assert 0 < sec["staging_device_bytes"] <= sec["staging_reserve_bytes"]
    handle.remove()
    with torch.no_grad():
        assert torch.equal(handle.module.to("cuda")(**xc)[0], ref)


def test_a_sharded_checkpoint_has_one_side_file_named_after_it(flux_checkpoints, tmp_path):
    root, model, x, ref = flux_checkpoints
    path = tmp_path / "sharded"
    shutil.copytree(root / "sharded", path)
    handle = _load(path, model, "tiered")
    _run(handle, x, ref, calls=2)
    assert handle.report()["codec"]["side_file"] == str(path / "diffusion_pytorch_model.ddo-tiered.units")
    handle.remove()
