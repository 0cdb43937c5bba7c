"""The NVMe route on the CPU: the model streamed from its safetensors files through the staging
thread's reader pool, exact for every RAM budget, sharded checkpoints, changed files, bad inputs and
removal into ordinary memory."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from diffusers import FluxTransformer2DModel

import ddo_blocks
from ddo_blocks import _native
from ddo_blocks.presets import ROUTES, describe, resolve
from ddo_blocks.streaming.edits import get_data
from ddo_blocks.tiny import tiny_flux_transformer

from .helpers import budgets, cuda_reference

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture
def saved(flux_checkpoints):
    return flux_checkpoints


def _load(path, model, ram_budget, **kw):
    kw.setdefault("vram_budget", budgets(model)["all_streamed"])
    return ddo_blocks.from_pretrained(FluxTransformer2DModel, path, route="nvme", ram_budget=ram_budget,
                                      device="cpu", progress=False, units="block", **kw)


def _streamed_bytes(model):
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "blocks." in n)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("ram", ["zero", "partial", "everything"])
def test_exact_for_every_ram_budget(saved, layout, ram):
    root, model, x, ref = saved
    ram_budget = {"zero": 0, "partial": _streamed_bytes(model) // 2, "everything": 1 << 40}[ram]
    handle = _load(root / layout, model, ram_budget)
    rep = handle.report()
    assert rep["route"] == "nvme" and rep["preset"] == "nvme_baseline"
    plan = rep["plan"]
    assert plan["streamed_units"] == 5
    assert plan["cached_units"] + plan["disk_units"] == 5
    assert plan["cached_bytes"] <= ram_budget
    if ram == "zero":
        assert plan["cached_units"] == 0 and plan["host_slab_bytes"] == 0
    elif ram == "partial":
        assert 0 < plan["cached_units"] < 5
    else:
        assert plan["disk_units"] == 0
    for _ in range(3):  # the cyclic prefetch wraps into the next call
        with torch.no_grad():
            assert torch.equal(handle.module(**x)[0], ref)
    rep = handle.report()
    assert rep["runtime"]["misses"] == 0
    if plan["disk_units"]:
        assert rep["runtime"]["file_fetches"] >= 3 * plan["disk_units"]
        assert rep["runtime"]["disk_call_bytes"] >= plan["disk_bytes"]
        assert rep["roofline"]["disk_bound_s"] > 0
        opened = [part.split(": ") for part in rep["setup"]["o_direct_files"].split(", ")]  # files of disk units
        assert opened and {name for name, _ in opened} <= {f.name for f in (root / layout).glob("*.safetensors")}
        assert all(direct in ("yes", "no") for _, direct in opened)
    else:
        assert rep["runtime"]["file_fetches"] == 0
    handle.remove()
    loaded = handle.module
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and p2.device.type == "cpu" and torch.equal(p1, p2), n1
        assert p2.is_contiguous() and p2.untyped_storage().nbytes() == p2.numel() * p2.element_size(), n1
    with torch.no_grad():
        assert torch.equal(loaded(**x)[0], ref)  # a plain module again


def test_calibrated_prediction_charges_disk_units_at_the_disk_rate(saved, monkeypatch):
    """With a disk far slower than the link, the calibrated prediction is at least the disk's read time
    of the units left on disk; with a fast disk it is shorter."""
    root, model, x, _ = saved
    predicted = {}
    for gbps in ("0.001", "1000"):
        monkeypatch.setenv("DDO_DISK_GBPS", gbps)
        handle = _load(root / "single", model, 0)
        with torch.no_grad():
            for _ in range(2):
                handle.module(**x)
        rep = handle.report()
        assert rep["plan"]["disk_units"] > 0
        predicted[gbps] = rep["runtime"]["calibrated_predicted_step_s"]
        if gbps == "0.001":
            assert predicted[gbps] >= 0.99 * rep["plan"]["disk_bytes"] / 1e6
        handle.remove()
    assert predicted["0.001"] > predicted["1000"]


def test_disk_units_hold_no_ram_between_calls(saved):
    root, model, x, ref = saved
    handle = _load(root / "single", model, 0)
    streamed = [p for n, p in handle.module.named_parameters() if "blocks." in n]
    assert streamed and all(get_data(p).untyped_storage().nbytes() <= 8 for p in streamed)
    for p in streamed:  # a placeholder is never read as if it were the weight
        with pytest.raises(ddo_blocks.OffloadStateError, match="placeholder"):
            torch.isnan(p)
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)
    assert all(get_data(p).untyped_storage().nbytes() <= 8 for p in streamed)
    handle.remove()


def test_everything_resident_without_a_budget(saved):
    root, model, x, ref = saved
    handle = _load(root / "sharded", model, 0, vram_budget=None)
    assert handle.report()["plan"]["streamed_units"] == 0
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)
    handle.remove()


def test_auto_sizes_the_cache_from_available_ram(saved):
    root, model, x, ref = saved
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root / "single", route="nvme", preset="auto",
                                        vram_budget=budgets(model)["all_streamed"], device="cpu", progress=False,
                                        units="block")
    assert handle.requested_preset == "auto"
    assert handle.report()["plan"]["disk_units"] == 0  # a tiny model fits in half the available RAM
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)
    handle.remove()
    handle = _load(root / "single", model, None, preset="nvme_baseline")  # no cache unless asked
    assert handle.report()["plan"]["cached_units"] == 0
    handle.remove()


def test_disk_bandwidth_is_measured_or_overridden(saved, monkeypatch):
    root, model, *_ = saved
    handle = _load(root / "single", model, 0)
    rep = handle.report()
    assert "MiB read from diffusion_pytorch_model.safetensors" in rep["setup"]["disk_probe"]
    assert rep["roofline"]["disk_gb_s"] > 0
    handle.remove()
    monkeypatch.setenv("DDO_DISK_GBPS", "2.5")
    handle = _load(root / "single", model, 0)
    rep = handle.report()
    assert rep["roofline"]["disk_gb_s"] == pytest.approx(2.5)
    assert rep["setup"]["disk_probe"] == "DDO_DISK_GBPS=2.5"
    assert rep["roofline"]["disk_bound_s"] == pytest.approx(rep["plan"]["disk_bytes"] / 2.5e9)
    handle.remove()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("change", ["replaced", "truncated", "touched", "deleted"])
def test_changed_file_is_a_checkpoint_error(saved, tmp_path, change):
    root, model, x, ref = saved
    d = _copy(root / "single", tmp_path / "m")
    handle = _load(d, model, 0)
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)
    f = d / WEIGHTS
    data = f.read_bytes()
    if change == "replaced":  # a new file renamed over the old one
        tmp = d / "new.tmp"
        tmp.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, other weights
        st = f.stat()
        os.replace(tmp, f)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    elif change == "truncated":
        with open(f, "r+b") as fh:
            fh.truncate(len(data) - 1000)
    elif change == "deleted":
        f.unlink()
    else:
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    what = "No such file" if change == "deleted" else "changed on disk"
    for _ in range(2):  # every call checks, not only the first after the change
        with pytest.raises(ddo_blocks.CheckpointError, match=rf"route='nvme'.*{what}.*load the model again"), \
                torch.no_grad():
            handle.module(**x)
    # the weights cannot be restored from a changed file: removal says so and leaves placeholders
    with pytest.raises(ddo_blocks.CheckpointError, match="was removed, but .* could not be restored"):
        handle.remove()
    # ... and state agrees with the message: removed, and the module cannot pass for a loaded one
    assert handle.removed and ddo_blocks.get_handle(handle.module) is None
    with pytest.raises(ddo_blocks.OffloadStateError, match="already removed"):
        handle.remove()
    with pytest.raises(ddo_blocks.OffloadStateError, match="could not be read back.*Load the model again"):
        ddo_blocks.offload(handle.module, device="cpu")


@pytest.mark.parametrize("failure", [MemoryError("simulated"),
                                     RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't "
                                                  "allocate memory: you tried to allocate 1 bytes")],
                         ids=["MemoryError", "torch-allocator"])
def test_out_of_memory_during_remove_keeps_the_offload_working(saved, monkeypatch, failure):
    root, model, x, ref = saved
    handle = _load(root / "single", model, 0)
    loader = handle.engine.loader

    def no_memory(pairs):
        raise failure

    monkeypatch.setattr(loader, "read_many", no_memory)
    with pytest.raises(ddo_blocks.OffloadMemoryError, match=r"still in place.*remove\(\) again"):
        handle.remove()
    assert not handle.removed
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)  # still offloaded, still exact
    monkeypatch.undo()
    handle.remove()
    assert handle.removed
    for (n, p1), (_, p2) in zip(model.named_parameters(), handle.module.named_parameters()):
        assert torch.equal(p1, p2), n
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)


def test_offload_without_files_points_to_from_pretrained():
    module = tiny_flux_transformer()
    with pytest.raises(ddo_blocks.ConfigError, match=r"from_pretrained\(ModelClass, path, route='nvme'"):
        ddo_blocks.offload(module, route="nvme", device="cpu", vram_budget="1MiB")
    assert ddo_blocks.get_handle(module) is None
    # the blocks pass their policy to offload(): the same error, at stage start
    policy = ddo_blocks.OffloadPolicy(route="nvme", options={"ram_budget": "1GiB"})
    with pytest.raises(ddo_blocks.ConfigError, match="from_pretrained"):
        ddo_blocks.offload(module, device="cpu", **policy.offload_kwargs())


def test_bad_inputs(saved):
    root, model, *_ = saved
    with pytest.raises(ddo_blocks.ConfigError, match="ram_budget=-1 must be a non-negative"):
        _load(root / "single", model, -1)
    with pytest.raises(ddo_blocks.ConfigError, match="ram_budget='lots' is not a size"):
        _load(root / "single", model, "lots")
    with pytest.raises(ddo_blocks.ConfigError, match="unknown preset 'fast' for route 'nvme'; valid presets: auto, nvme_baseline"):
        _load(root / "single", model, 0, preset="fast")
    with pytest.raises(ddo_blocks.ConfigError, match="route 'nvme' does not take surprise"):
        _load(root / "single", model, 0, surprise=1)
    with pytest.raises(ddo_blocks.ConfigError, match="streams tensors from the files as stored.*dtype=None"):
        _load(root / "single", model, 0, dtype=torch.float32, vram_budget=2 * budgets(model)["all_streamed"])
    with pytest.raises(ddo_blocks.ConfigError, match="ram_budget"):
        ddo_blocks.OffloadPolicy(route="nvme", options={"ram": 1})


def test_presets_and_planner_bindings():
    assert set(ROUTES["nvme"]) == {"nvme_baseline"}
    assert resolve("nvme", "auto").name == "nvme_baseline"
    text = describe()
    assert "nvme_baseline" in text and "ram_budget" in text
    mib = 1 << 20
    common = {"unit_compute_s": [0.001] * 4, "resident": [False] * 4, "slots": 2, "link_bytes_per_s": 50e9,
              "disk_bytes_per_s": 5e9}
    none = _native.plan_ram_cache([100 * mib] * 4, ram_budget_bytes=0, **common)
    assert none.cached == [False] * 4 and none.disk_bytes == 400 * mib
    assert none.bound_s == pytest.approx(400 * mib / 5e9)
    half = _native.plan_ram_cache([100 * mib] * 4, ram_budget_bytes=200 * mib, **common)
    assert sum(half.cached) == 2 and half.predicted_step_s < none.predicted_step_s
    assert half.to_dict()["cached_bytes"] == 200 * mib
    with pytest.raises(ddo_blocks.PlanError, match="disk_bytes_per_s"):
        _native.plan_ram_cache([1], **{**common, "unit_compute_s": [0.0], "resident": [False], "disk_bytes_per_s": 0.0},
                               ram_budget_bytes=0)
    sim = _native.simulate([100] * 2, [0.0] * 2, [False] * 2, 2, 100.0, 4, [True, True], 50.0)
    assert sim.step_s == pytest.approx(4.0)


def test_native_reader_is_exact_and_reports_truncation(tmp_path):
    data = bytes(range(256)) * 4000
    f = tmp_path / "w.bin"
    f.write_bytes(data)
    t = _native.Transport("cpu", 0, 2, 0, (2, 8192, 2, False), stage_host=False)
    fid = t.open_file(str(f))
    unit = t.add_file_unit([(fid, 5, 20000, 0), (fid, 20005, 3000, 20224), (fid, 900_000, 100, 23296)])
    slot = torch.zeros(30000, dtype=torch.uint8)
    t.fetch_file(0, slot.data_ptr(), unit)
    t.acquire(0, 0)
    got = bytes(slot.numpy())
    assert got[:20000] == data[5:20005]
    assert got[20224:23224] == data[20005:23005]
    assert got[23296:23396] == data[900_000:900_100]
    t.release(0, 0)
    assert t.disk_stats()[0] == 1
    with open(f, "r+b") as fh:
        fh.truncate(100_000)
    t.fetch_file(1, slot.data_ptr(), unit)
    with pytest.raises(ddo_blocks.CheckpointError, match=r"w.bin.*truncated or replaced while offloaded"):
        t.acquire(1, 0)
    with pytest.raises(ddo_blocks.ConfigError, match="need a staging ring"):
        _native.Transport("cpu", 0, 2).add_file_unit([])


@pytest.mark.gpu
@pytest.mark.parametrize("ram", ["zero", "partial", "everything"])
def test_cuda_exact_from_disk(saved, ram):
    """On the GPU: pinned staging ring, O_DIRECT reads, pinned RAM cache, exact output."""
    root, model, x, _ = saved
    ref, xc = cuda_reference(model, x)
    ram_budget = {"zero": 0, "partial": _streamed_bytes(model) // 2, "everything": 1 << 40}[ram]
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root / "sharded", route="nvme", ram_budget=ram_budget,
                                        device="cuda", vram_budget=budgets(model)["all_streamed"], progress=False,
                                        units="block")
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(handle.module(**xc)[0], ref)
    rep = handle.report()
    assert rep["memory"]["pinned_bytes"] == rep["plan"]["host_slab_bytes"]
    handle.remove()
    with torch.no_grad():
        assert torch.equal(handle.module.to("cuda")(**xc)[0], ref)


def test_a_failed_attach_does_not_read_the_disk_units_back(saved, monkeypatch):
    from ddo_blocks.streaming import slots

    root, model, _, _ = saved
    reads = {"failed": False, "after": 0}
    real = ddo_blocks.loading.Loader.read_many

    def counting(self, pairs):
        reads["after"] += reads["failed"]
        return real(self, pairs)

    def no_slots(self, *a, **k):
        reads["failed"] = True
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(ddo_blocks.loading.Loader, "read_many", counting)
    monkeypatch.setattr(slots.TorchSlots, "build", no_slots)
    with pytest.raises(ddo_blocks.OffloadMemoryError, match="out of GPU memory"):
        _load(root / "single", model, 0)
    assert reads["failed"] and reads["after"] == 0  # nothing read back for a module that is discarded
