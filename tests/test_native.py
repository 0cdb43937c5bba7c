"""The Rust core through the extension: safetensors index, planner, layout, transport."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import ddo_blocks
from ddo_blocks import _native


@pytest.fixture
def st_file(tmp_path):
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_index_lists_tensors_and_reads_exact_bytes(st_file):
    path, tensors = st_file
    idx = _native.SafetensorsIndex(path)
    info = {name: (dtype, shape, nbytes) for name, dtype, shape, _, nbytes in idx.tensors()}
    assert info["a"] == ("F32", [3, 4], 48)
    assert info["b"] == ("BF16", [5], 10)
    assert info["empty"] == ("F32", [0, 3], 0)
    assert idx.metadata() == {"format": "pt"}
    out = torch.empty(3, 4)
    assert idx.read_into("a", out.data_ptr()) == 48
    assert torch.equal(out, tensors["a"])
    with pytest.raises(ddo_blocks.CheckpointError, match="'missing'|\"missing\""):
        idx.read_into("missing", out.data_ptr())
    idx.check_unchanged()


def test_truncated_file_is_a_clear_error(st_file):
    path, _ = st_file
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    with pytest.raises(ddo_blocks.CheckpointError, match=r"model\.safetensors.*truncated"):
        _native.SafetensorsIndex(path)


def test_corrupt_header_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    header = b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}'
    bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ddo_blocks.CheckpointError, match=r"bad\.safetensors.*'a'|bad\.safetensors.*\"a\""):
        _native.SafetensorsIndex(bad)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(ddo_blocks.CheckpointError, match="tiny.safetensors"):
        _native.SafetensorsIndex(tiny)
    with pytest.raises(ddo_blocks.CheckpointError, match="nope.safetensors"):
        _native.SafetensorsIndex(tmp_path / "nope.safetensors")


def test_replaced_file_is_detected(st_file):
    path, _tensors = st_file
    idx = _native.SafetensorsIndex(path)
    save_file({"a": torch.zeros(100)}, str(path))
    with pytest.raises(ddo_blocks.CheckpointError):
        idx.check_unchanged()


def test_shard_index(tmp_path):
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(json.dumps({"metadata": {}, "weight_map": {"a": "m-00001.safetensors", "b": "m-00002.safetensors"}}))
    assert _native.read_shard_index(p) == {"a": "m-00001.safetensors", "b": "m-00002.safetensors"}
    p.write_text("{not json")
    with pytest.raises(ddo_blocks.CheckpointError, match="index.json"):
        _native.read_shard_index(p)


def test_planner_from_python():
    plan = _native.plan([100, 100, 100, 100], base_bytes=10, budget_bytes=10 + 2 * 100, link_bytes_per_s=1e9,
                        compute_bytes_per_s=1e9)
    assert plan.slots == 2 and plan.resident == [False] * 4 and plan.gpu_bytes == 210
    assert plan.slot_bytes == 100 and plan.resident_bytes == 10 and plan.streamed_bytes == 400
    assert plan.to_dict()["gpu_bytes"] == 210 and set(plan.to_dict()) == {
        "resident", "slots", "slot_bytes", "prefetch_depth", "resident_bytes", "streamed_bytes", "gpu_bytes",
        "predicted_step_s", "bound_s"}
    assert repr(plan).startswith("Plan(resident=[False, False, False, False], slots=2, slot_bytes=100,")
    with pytest.raises(AttributeError):
        plan.slots = 3  # frozen
    everything = _native.plan([100, 100], base_bytes=10, budget_bytes=None, link_bytes_per_s=1e9,
                              compute_bytes_per_s=1e9)
    assert everything.slots == 0 and all(everything.resident) and everything != plan
    with pytest.raises(ddo_blocks.BudgetError, match="minimum"):
        _native.plan([100, 100, 100], base_bytes=10, budget_bytes=150, link_bytes_per_s=1e9, compute_bytes_per_s=1e9)
    two_slots = _native.minimum_budget([100, 100, 100], 10)
    assert two_slots.bytes == 10 + 2 * 100 and two_slots.slots == 2 and two_slots.largest_unit == 100
    assert _native.minimum_budget([100, 50], 10).bytes == 10 + 150  # keeping both is cheaper than two slots


def test_simulate_with_and_without_a_disk():
    args = ([1 << 20] * 4, [0.0] * 4, [False] * 4, 2, 1e9)
    link = _native.simulate(*args, 3).step_s
    disk = _native.simulate(*args, 3, [True] * 4, 1e8).step_s
    assert repr(_native.simulate(*args, 3)).startswith("SimResult(step_s=")
    assert disk >= 0.99 * (4 << 20) / 1e8 > link
    for half in (([True] * 4, None), (None, 1e8)):
        with pytest.raises(ddo_blocks.PlanError, match="both from_disk and disk_bytes_per_s"):
            _native.simulate(*args, 3, *half)


def test_layout_is_aligned_and_exact():
    layout = _native.layout_unit([10, 0, 300, 7])
    assert all(o % 256 == 0 for o in layout.offsets)
    assert layout.nbytes % 256 == 0 and layout.nbytes >= 317
    assert repr(layout) == "UnitLayout(offsets=[0, 256, 256, 768], nbytes=1024)"
    slabs = _native.layout_slabs([1000, 2000, 5000], 4096)
    assert sum(slabs.slabs) >= 8000
    assert all(p.offset % 256 == 0 for p in slabs.placements)
    assert [(p.slab, p.nbytes) for p in slabs.placements] == [(0, 1000), (0, 2000), (1, 5000)]


def test_host_transport_roundtrip_direct_and_staged():
    for staging in (None, (3, 4096, 2, False)):
        t = _native.Transport("cpu", 0, 2, 0, staging)
        src = torch.arange(10_000, dtype=torch.int32)
        dst = torch.zeros(2, 10_000, dtype=torch.int32)
        t.fetch(1, dst[1].data_ptr(), src.data_ptr(), 40_000)
        t.acquire(1, 0)
        assert torch.equal(dst[1], src)
        t.release(1, 0)
        t.close()  # raises what the teardown met (nothing here)
        t.close()
        with pytest.raises(ddo_blocks.ConfigError, match="closed"):
            t.fetch(0, dst[0].data_ptr(), src.data_ptr(), 4)
    assert _native.take_deferred_error() is None


def test_copy_host_many():
    a, b = torch.arange(100, dtype=torch.uint8), torch.arange(50, dtype=torch.uint8)
    out = torch.zeros(150, dtype=torch.uint8)
    _native.copy_host_many([(out.data_ptr(), a.data_ptr(), 100), (out.data_ptr() + 100, b.data_ptr(), 50)])
    assert torch.equal(out, torch.cat([a, b]))


def test_type_stubs_cover_the_extension():
    """Every name the extension exports (and every method of its classes) is in _native.pyi."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(ddo_blocks.__file__).parent / "_native.pyi").read_text())
    stubbed: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stubbed[node.name] = {n.name for n in getattr(node, "body", []) if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stubbed[node.target.id] = set()
    for name in dir(_native):
        if name.startswith("_") and name != "__version__":
            continue
        assert name in stubbed, f"{name} missing from _native.pyi"
        obj = getattr(_native, name)
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            public = {m for m in vars(obj) if not m.startswith("_")}
            assert public <= stubbed[name], f"{name}: {public - stubbed[name]} missing from _native.pyi"
