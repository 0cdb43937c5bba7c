"""The NVMe route's coded side file (``route="nvme", codec=...``): the units it reads from disk,
coded (``ddo-core``'s fixed-rate or two-tier code), in a file of their own next to the checkpoint,
never inside it, so every call reads fewer bytes from the disk and sends fewer over the link.

- ``<stem>.ddo-<codec>.units``: each unit's coded buffer (the layout ``CodedSlabs`` holds in RAM),
  4 KiB aligned, so ``O_DIRECT`` reads it as it reads the checkpoint.
- ``<stem>.ddo-<codec>.json``: the key and every unit's layout inputs (its tensors' slot offsets,
  sizes, counts). Written last (a rename): a side file without it, or with another key, is coded
  again.
- The key: the format, the codec, each checkpoint file's identity (size, modification time in
  nanoseconds, inode) and a hash of its first and last MiB, and each unit's tensors (name, file,
  offset, size, slot offset). It is not a hash of every byte: a checkpoint rewritten in place with
  its size and times kept would not be seen (no download or copy does that). The side file's own
  identity is checked before every call, as the checkpoint's is. Two processes that code the same
  side file at once both write it (each its own temporary file, renamed into place); the one whose
  file was replaced stops at its next call with a ``CheckpointError`` (attach again: the side file
  is then found).

Coding reads each disk unit's tensors from the checkpoint (one unit in RAM at a time), counts,
lays out and codes them in parallel Rust, and writes the buffer; the second attach only reads the
JSON. The reads at run time decode on the copy stream (``Transport.fetch_file_coded``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _native
from ..errors import CheckpointError, ConfigError
from . import coded
from .slabs import _alloc, _progress

FORMAT = 1
ALIGN = 4096
SAMPLE_BYTES = 1 << 20
"""Bytes hashed at each end of a checkpoint file for the key."""


@dataclass
class SideFile:
    """A written (or found) side file: where each disk unit's coded bytes are, and their layouts."""

    path: Path
    codec: str
    offsets: list[int]
    layouts: list[Any]  # _native.CodedUnit per disk unit
    reused: bool
    encode_s: float
    stamp: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layouts)

    def check_unchanged(self) -> None:
        try:
            now = _stamp(self.path)
        except OSError as exc:
            raise CheckpointError(f"the coded side file {self.path} is gone ({exc})") from exc
        if now != self.stamp:
            raise CheckpointError(f"the coded side file {self.path} changed on disk since it was written or opened")


def _stamp(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def _file_key(path: Path) -> list[Any]:
    size, mtime, ino = _stamp(path)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > 2 * SAMPLE_BYTES:
            f.seek(size - SAMPLE_BYTES)
            h.update(f.read(SAMPLE_BYTES))
    return [path.name, size, mtime, ino, h.hexdigest()]


def paths(directory: Path, stem: str, codec: str) -> tuple[Path, Path]:
    return directory / f"{stem}.ddo-{codec}.units", directory / f"{stem}.ddo-{codec}.json"


def prepare(checkpoint: Any, codec: str, units: list[list[tuple[str, Any, int, torch.Tensor]]], *,
            directory: Path | None = None) -> SideFile:
    """The side file of ``codec`` for these disk ``units`` (per unit, per tensor: name, its
    ``loading.TensorSource``, its offset in the slot, the parameter), found or written.
    ``directory``: where it goes (default: the checkpoint's)."""
    if codec not in coded.CODES:
        raise ConfigError(f"the NVMe route codes with {' or '.join(map(repr, coded.CODES))}, not {codec!r}")
    directory = Path(directory) if directory is not None else checkpoint.directory
    files = sorted({src.path for unit in units for _, src, _, _ in unit})
    # the checkpoint's name without a shard's "-00001-of-00003"
    stem = re.sub(r"-\d+-of-\d+$", "", files[0].name.split(".")[0]) if files else "model"
    data, header = paths(directory, stem, codec)
    key = {
        "format": FORMAT,
        "codec": codec,
        "files": [_file_key(f) for f in files],
        "units": [[[name, src.path.name, src.offset, src.nbytes, off] for name, src, off, _ in unit] for unit in units],
    }
    found = _read(data, header, key)
    if found is not None:
        return found
    return _write(data, header, key, codec, units)


def _layout(entry: dict[str, Any]) -> Any:
    return _native.layout_coded_unit([tuple(s) for s in entry["specs"]], entry["escapes"], 1 << 62, entry["groups"])


def _read(data: Path, header: Path, key: dict[str, Any]) -> SideFile | None:
    try:
        meta = json.loads(header.read_text())
        stamp = _stamp(data)
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or meta.get("stamp") != list(stamp):
        return None
    layouts = [_layout(e) for e in meta["units"]]
    if [c.nbytes for c in layouts] != [e["nbytes"] for e in meta["units"]]:
        return None
    return SideFile(data, key["codec"], [e["offset"] for e in meta["units"]], layouts, True, 0.0, stamp)


def _write(data: Path, header: Path, key: dict[str, Any], codec: str,
           units: list[list[tuple[str, Any, int, torch.Tensor]]]) -> SideFile:
    t0 = time.perf_counter()
    tmp = data.with_name(f"{data.name}.tmp-{os.getpid()}")
    entries: list[dict[str, Any]] = []
    layouts: list[Any] = []
    total = sum(src.nbytes for unit in units for _, src, _, _ in unit)
    try:
        f = open(tmp, "wb")  # noqa: SIM115 (closed by the with below; its failure has its own message)
    except OSError as exc:
        raise ConfigError(
            f"route='nvme' with codec={codec!r} writes its coded side file next to the checkpoint, and {data.parent} "
            f"is not writable ({exc}); pass codec_dir='<a writable directory>' or codec='off'"
        ) from exc
    try:
        with f, _progress(total, f"coding to {data.name}") as bar:
            offset = 0
            for unit in units:
                srcs = []
                for _, src, _, p in unit:
                    t = torch.empty(src.nbytes, dtype=torch.uint8)
                    _native.read_file_into(src.path, [(src.offset, src.nbytes, t.data_ptr())])
                    srcs.append(t.view(p.dtype) if src.nbytes % p.element_size() == 0 else t)
                bf16 = [p.dtype == torch.bfloat16 and t.numel() >= coded.MIN_CODED_VALUES and t.dtype == torch.bfloat16
                        for (_, _, _, p), t in zip(unit, srcs)]
                esc, groups = coded._count(codec, [(t.data_ptr(), t.numel()) for t, b in zip(srcs, bf16) if b])
                specs = [(off, src.nbytes, b) for (_, src, off, _), b in zip(unit, bf16)]
                entry = {"specs": specs, "escapes": coded._per_tensor(esc, bf16),
                         "groups": coded._per_tensor(groups, bf16) if groups is not None else None}
                layout = _layout(entry)
                _, buf = _alloc(layout.nbytes)
                _native.codec_encode_unit(layout, [(t.data_ptr(), t.numel() * t.element_size()) for t in srcs],
                                          buf.data_ptr())
                f.seek(offset)
                f.write(memoryview(buf.numpy()))
                entries.append({**entry, "offset": offset, "nbytes": layout.nbytes})
                layouts.append(layout)
                offset = -(-(offset + layout.nbytes) // ALIGN) * ALIGN
                bar.update(sum(src.nbytes for _, src, _, _ in unit))
            f.truncate(max(offset, 1))
        os.replace(tmp, data)
        stamp = _stamp(data)
        side = header.with_name(f"{header.name}.tmp-{os.getpid()}")
        side.write_text(json.dumps({"key": key, "stamp": list(stamp), "units": entries}))
        os.replace(side, header)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return SideFile(data, codec, [e["offset"] for e in entries], layouts, False, time.perf_counter() - t0, stamp)


def unit_tensors(engine: Any, u: int, loader: Any) -> list[tuple[str, Any, int, torch.Tensor]]:
    """Streamed unit ``u``'s tensors as :func:`prepare` takes them."""
    return [(name, loader.source(p), off, p)
            for (name, p), off in zip(engine.streamed[u].params, engine.offsets[u])]


def coded_span(layouts: list[Any]) -> int:
    """Device bytes the staging buffer needs: the largest coded unit."""
    return max((c.nbytes for c in layouts), default=0)


RESERVE_SLACK = 0.03
"""The staging buffer's reserve over the largest unit's estimated coded size (escapes and tier-2 codes
above the estimate's); a unit whose coded size exceeds it is read as stored."""


def nvme_codec(codec: str, device: torch.device) -> str:
    """The code the NVMe route uses for ``codec``: ``lossless`` is the two-tier code (the smaller one:
    the disk, 2-14 GB/s, is the bound, and either decode runs at hundreds of GB/s), or the fixed-rate
    one where the two-tier kernel failed its check on this device."""
    if codec != "lossless":
        return codec
    if device.type == "cuda" and coded.planning_rate(device, "tiered") is None:
        return "fixed"
    return "tiered"


def reserve_bytes(module: torch.nn.Module, codec: str, device: torch.device) -> int:
    """Device bytes the NVMe route's coded reads need beside the slots: the staging buffer of the
    largest unit coded (its estimate, :data:`RESERVE_SLACK` over it)."""
    if codec == "off" or device.type != "cuda":
        return 0
    from ..units import split_units

    est = max((coded.coded_estimate([u], nvme_codec(codec, device))[0] for u in split_units(module)[0]), default=0)
    return -(-int(est * (1 + RESERVE_SLACK)) // ALIGN) * ALIGN
