"""Never silently wrong about a checkpoint: the safetensors index accepts exactly what the reference
implementation (the pinned ``safetensors`` package) reads, with the same tensors and bytes, and
refuses the rest with ``CheckpointError``; it notices a file rewritten or replaced behind its back,
even with the modification time restored; it keeps no memory map of the file."""

from __future__ import annotations

import json
import os
import random
import struct
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ddo_blocks
from ddo_blocks import _native

from .helpers import budgets

FUZZ_SEED = 20240613
FUZZ_MUTANTS = 600


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _seed_file(path) -> bytes:
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.arange(5, dtype=torch.bfloat16),
        "c": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "u": torch.arange(4, dtype=torch.uint8),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def _split(data: bytes) -> tuple[list[tuple[str, object]], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return list(header.items()), data[8 + n :]


def _join(entries: list[tuple[str, object]], body: bytes) -> bytes:
    text = "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in entries) + "}"
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw + body


_DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "f32", "Q4_K", ""]
_ODD = [None, -1, 1.5, "7", [], {}, 2**64 - 1, True, [1, 2, 3]]


def _edit_json(entries: list[tuple[str, object]], body: bytes, rng: random.Random) -> tuple[list, bytes]:
    entries = [(k, json.loads(json.dumps(v))) for k, v in entries]
    tensors = [i for i, (k, v) in enumerate(entries) if k != "__metadata__" and isinstance(v, dict)]
    op = rng.randrange(11)
    t = entries[rng.choice(tensors)][1] if tensors else None
    if op <= 1 and t is not None and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2:
        k = rng.randrange(2)
        old = t["data_offsets"][k] if isinstance(t["data_offsets"][k], int) else 0
        t["data_offsets"][k] = max(0, old + rng.choice([-3, -1, 1, 2, 8])) if rng.random() < 0.7 else rng.randrange(64)
    elif op == 2 and t is not None:
        t["dtype"] = rng.choice(_DTYPES)
    elif op == 3 and t is not None and isinstance(t.get("shape"), list):
        shape = t["shape"]
        choice = rng.randrange(4)
        if choice == 0:
            shape.append(rng.randrange(4))
        elif choice == 1 and shape:
            shape.pop()
        elif choice == 2 and shape:
            shape[0] = rng.randrange(5)
        else:
            shape.reverse()
    elif op == 4 and t is not None:
        field = rng.choice(["dtype", "shape", "data_offsets", "extra"])
        if rng.random() < 0.5:
            t.pop(field, None)
        else:
            t[field] = rng.choice(_ODD)
    elif op in (5, 6) and entries:
        # a repeated key: the same entry again, or another entry under this name
        name = rng.choice(entries)[0]
        entries.insert(rng.randrange(len(entries) + 1), (name, json.loads(json.dumps(rng.choice(entries)[1]))))
    elif op == 7 and entries:
        entries.pop(rng.randrange(len(entries)))
    elif op == 8:
        body = body[: rng.randrange(len(body) + 1)] if rng.random() < 0.5 else body + b"\xab" * rng.randint(1, 8)
    elif op == 9:
        entries = [(k, v) for k, v in entries if k != "__metadata__"]
        entries.insert(0, ("__metadata__", rng.choice([None, {"k": 1}, "pt", {"format": "pt", "k": "v"}])))
    elif len(tensors) >= 2:
        i, j = rng.sample(tensors, 2)
        a, b = entries[i][1], entries[j][1]
        a["data_offsets"], b["data_offsets"] = b.get("data_offsets"), a.get("data_offsets")
    return entries, body


def _edit_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and b:
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        b[rng.randrange(len(b))] = rng.choice(b'{}[],:"0123456789-.e \x00\xff')
    elif op == 2:
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    elif op == 3 and b:
        i = rng.randrange(len(b))
        del b[i : i + rng.randint(1, 8)]
    elif op == 4 and len(b) >= 8:
        (n,) = struct.unpack("<Q", bytes(b[:8]))
        n = rng.choice([n + 1, n - 1, n + rng.randrange(64), 2**64 - 1, rng.randrange(len(b) + 8)]) % 2**64
        b[:8] = struct.pack("<Q", n)
    else:
        del b[rng.randrange(len(b) + 1) :]
    return bytes(b)


def _mutant(seed: bytes, rng: random.Random) -> bytes:
    entries, body = _split(seed)
    edits = rng.randrange(3)
    for _ in range(edits):
        entries, body = _edit_json(entries, body, rng)
    data = _join(entries, body)
    for _ in range(rng.randint(1, 3) if edits == 0 else int(rng.random() < 0.25)):
        data = _edit_bytes(data, rng)
    return data


def _ours(path) -> dict | None:
    """Names, dtypes, shapes and bytes as read through the index, or None for a CheckpointError."""
    try:
        idx = _native.SafetensorsIndex(path)
        out = {}
        for name, dtype, shape, _offset, nbytes in idx.tensors():
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            assert idx.read_into(name, buf.data_ptr()) == nbytes
            out[name] = (dtype, list(shape), buf[:nbytes].numpy().tobytes())
        return out
    except ddo_blocks.CheckpointError as exc:
        assert path.name in str(exc), exc
        return None


def _reference(path) -> dict | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape()), _tensor_bytes(f.get_tensor(k)))
                for k in f.keys()  # noqa: SIM118 - a safe_open handle, not a dict
            }
    except Exception:  # noqa: BLE001 - any refusal of the reference counts as a refusal
        return None


def test_mutated_files_read_as_the_reference_reads_them_or_raise_checkpoint_error(tmp_path):
    seed = _seed_file(tmp_path / "seed.safetensors")
    assert _ours(tmp_path / "seed.safetensors") == _reference(tmp_path / "seed.safetensors") is not None
    rng = random.Random(FUZZ_SEED)
    outcomes = {"same": 0, "refused by both": 0, "refused by ddo_blocks only": 0}
    path = tmp_path / "mutant.safetensors"
    for i in range(FUZZ_MUTANTS):
        data = _mutant(seed, rng)
        path.write_bytes(data)
        ours, ref = _ours(path), _reference(path)
        if ours is not None:
            assert ref is not None, f"mutant {i} accepted, but the reference refuses it: {data[:400]!r}"
            assert ours == ref, f"mutant {i} read differently from the reference: {data[:400]!r}"
            outcomes["same"] += 1
        else:
            outcomes["refused by both" if ref is None else "refused by ddo_blocks only"] += 1
    assert outcomes["same"] > 10 and outcomes["refused by both"] > FUZZ_MUTANTS // 4, outcomes


@pytest.mark.parametrize(
    ("header", "body", "message"),
    [
        (
            {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
             "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}},
            b"\0" * 6,
            r"tensor 'b' \(data_offsets \[4, 6\]\) starts at byte 4 .* bytes 2\.\.4 belong to no tensor",
        ),
        (
            {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
             "z": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]}},
            b"\0" * 4,
            r"tensors 'a' .* and 'z' .* overlap",
        ),
    ],
)
def test_holes_and_hidden_tensors_are_refused(tmp_path, header, body, message):
    path = tmp_path / "hole.safetensors"
    path.write_bytes(_join(list(header.items()), body))
    assert _reference(path) is None
    with pytest.raises(ddo_blocks.CheckpointError, match=r"hole\.safetensors.*" + message):
        _native.SafetensorsIndex(path)


def test_a_tensor_listed_twice_is_refused_and_named(tmp_path):
    path = tmp_path / "twice.safetensors"
    entry = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}
    path.write_bytes(_join([("w", {**entry, "shape": [1], "data_offsets": [0, 1]}), ("w", entry)], b"\1\2"))
    with pytest.raises(ddo_blocks.CheckpointError, match=r"twice\.safetensors.*tensor 'w' is listed twice"):
        _native.SafetensorsIndex(path)


# ---------------------------------------------------------------------------------------------
# a file changed behind the index's back
# ---------------------------------------------------------------------------------------------
def _write_checkpoint(path, fill: float = 1.0) -> None:
    save_file({"w": torch.full((64,), fill), "b": torch.arange(8, dtype=torch.int64)}, str(path))


def _restore_mtime(path, st: os.stat_result) -> None:
    """Sets the modification time back to ``st``'s until the status-change time differs from it
    (file timestamps move with the kernel's coarse clock: a few milliseconds)."""
    for _ in range(200):
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        if os.stat(path).st_ctime_ns != st.st_ctime_ns:
            return
        time.sleep(0.005)
    raise AssertionError(f"the status-change time of {path} never moved")


def test_same_size_rewrite_with_the_mtime_restored_is_detected(tmp_path):
    path = tmp_path / "model.safetensors"
    _write_checkpoint(path)
    idx = _native.SafetensorsIndex(path)
    st = os.stat(path)
    data = path.read_bytes()
    with open(path, "r+b") as f:  # in place, as cp -p or rsync --inplace would: same inode, same size
        f.write(data[:-8] + struct.pack("<q", 12345))
    _restore_mtime(path, st)
    now = os.stat(path)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    with pytest.raises(ddo_blocks.CheckpointError,
                       match=r"model\.safetensors.*changed on disk.*status-change time.*rewritten in place"):
        idx.check_unchanged()


def test_same_size_file_renamed_over_the_path_is_detected(tmp_path):
    path = tmp_path / "model.safetensors"
    _write_checkpoint(path)
    idx = _native.SafetensorsIndex(path)
    st = os.stat(path)
    other = tmp_path / "download.tmp"
    _write_checkpoint(other, fill=2.0)
    assert other.stat().st_size == st.st_size
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(ddo_blocks.CheckpointError,
                       match=r"model\.safetensors.*changed on disk.*the path now names another file.*replaced"):
        idx.check_unchanged()
    # reads still come from the file that was validated, not from the one now at the path
    out = torch.empty(64)
    idx.read_into("w", out.data_ptr())
    assert torch.equal(out, torch.full((64,), 1.0))


def test_unchanged_file_passes_and_a_removed_one_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "model.safetensors"
    _write_checkpoint(path)
    idx = _native.SafetensorsIndex(path)
    idx.check_unchanged()
    os.utime(path, None)  # a touch moves the modification time
    with pytest.raises(ddo_blocks.CheckpointError, match="changed on disk.*modification time"):
        idx.check_unchanged()
    path.unlink()
    with pytest.raises(ddo_blocks.CheckpointError, match=r"model\.safetensors"):
        idx.check_unchanged()


# ---------------------------------------------------------------------------------------------
# no memory map of the checkpoint
# ---------------------------------------------------------------------------------------------
def _mapped(path) -> bool:
    target = str(path.resolve())
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(target) for line in f)


def test_index_reads_the_header_without_mapping_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    _write_checkpoint(path)
    idx = _native.SafetensorsIndex(path)
    assert sorted(t[0] for t in idx.tensors()) == ["b", "w"]
    assert not _mapped(path), "the index keeps the checkpoint memory-mapped"
    out = torch.empty(8, dtype=torch.int64)
    assert idx.read_into("b", out.data_ptr()) == 64
    assert torch.equal(out, torch.arange(8, dtype=torch.int64))
    assert not _mapped(path)


def test_loaded_and_removed_offload_maps_no_checkpoint_file(flux_checkpoints):
    from diffusers import FluxTransformer2DModel

    root, model, x, ref = flux_checkpoints
    files = sorted((root / "sharded").glob("*.safetensors")) + [root / "single" / "diffusion_pytorch_model.safetensors"]
    for route, layout, options in (("linear", "sharded", {}), ("nvme", "single", {"ram_budget": 0})):
        handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root / layout, route=route, device="cpu",
                                            vram_budget=budgets(model)["all_streamed"], units="block",
                                            progress=False, **options)
        if route == "nvme":
            assert handle.report()["plan"]["streamed_units"] == 5
        with torch.no_grad():
            assert torch.equal(handle.module(**x)[0], ref)
        assert not any(_mapped(f) for f in files), route
        handle.remove()
        assert not any(_mapped(f) for f in files), route
