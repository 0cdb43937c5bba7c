"""The NVMe route's coded side file (``route="nvme", codec=...``): every tensor of the checkpoint,
coded (``ddo-core``'s fixed-rate, two-tier or Huffman code) or as stored, in a file of its own next to the
checkpoint, never inside it, so every call reads fewer bytes from the disk and sends fewer over the
link.

- ``<stem>.ddo-<codec>.units``: each tensor as a coded unit of its own (bf16 tensors of at least
  ``coded.MIN_CODED_VALUES`` values; the others as stored), one after the other in the
  checkpoint's order, 256-byte aligned. A streamed unit of any plan (budget, granularity, RAM
  cache) is composed of its tensors' blobs (``codec_compose``): one side file serves every plan.
- ``<stem>.ddo-<codec>.json``: the key and every tensor's place in the side file and its counts
  (from which its layout is made again). Written last (a rename): a side file without it, or with
  another key, is coded again.
- The key: the format, the codec, and each checkpoint file's identity (size, modification time in
  nanoseconds, inode) and a hash of its first and last MiB. It is not a hash of every byte: a
  checkpoint rewritten in place with its size and times kept would not be seen (no download or copy
  does that). The side file's own identity is checked before every call, as the checkpoint's is.
  Two processes that code the same side file at once both write it (each its own temporary file,
  renamed into place); the one whose file was replaced stops at its next call with a
  ``CheckpointError`` (attach again: the side file is then found).

Coding reads the checkpoint in groups of tensors of about :data:`GROUP_BYTES` (parallel positional
reads), counts, lays out and codes each tensor in parallel Rust, and writes the blobs; the second
attach only reads the JSON. The reads at run time decode on the copy stream
(``Transport.fetch_file_coded``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import _native
from ..errors import CheckpointError, ConfigError
from . import coded
from .slabs import _alloc, _progress

FORMAT = 2
ALIGN = 4096
BLOB_ALIGN = 256
"""Each tensor's blob in the side file, and in a unit's staging buffer, starts at a multiple of this."""
GROUP_BYTES = 256 << 20
"""Checkpoint bytes read (in parallel) before they are coded and written."""
SAMPLE_BYTES = 1 << 20
"""Bytes hashed at each end of a checkpoint file for the key."""


@dataclass
class Blob:
    """One tensor in the side file: where, and its layout (a coded unit of one tensor at slot 0)."""

    offset: int
    layout: Any  # _native.CodedUnit


@dataclass
class SideFile:
    """A written (or found) side file: every tensor's blob, by (checkpoint file name, offset)."""

    path: Path
    codec: str
    blobs: dict[tuple[str, int], Blob]
    reused: bool
    encode_s: float
    stamp: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return sum(b.layout.nbytes for b in self.blobs.values())

    def unit(self, sources: list[tuple[Any, int]]) -> tuple[Any, list[tuple[int, int, int]]] | None:
        """A unit of these ``(loading.TensorSource, slot offset)`` tensors from their blobs: its layout
        (its staging buffer holds the blobs one after the other) and its reads ``(offset in the side
        file, bytes, offset in the staging buffer)``; ``None`` when a tensor has no blob."""
        parts, reads, at = [], [], 0
        for src, slot in sources:
            blob = self.blobs.get((src.path.name, src.offset))
            if blob is None:
                return None
            parts.append((blob.layout, at, slot))
            reads.append((blob.offset, blob.layout.nbytes, at))
            at = -(-(at + blob.layout.nbytes) // BLOB_ALIGN) * BLOB_ALIGN
        return _native.codec_compose(parts), reads

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


def prepare(checkpoint: Any, codec: str, *, directory: Path | None = None) -> SideFile:
    """The side file of ``codec`` for every tensor of ``checkpoint`` (a ``loading.Checkpoint``), found
    or written. ``directory``: where it goes (default: the checkpoint's)."""
    if codec not in coded.CODES:
        raise ConfigError(f"the NVMe route codes with {' or '.join(map(repr, coded.CODES))}, not {codec!r}")
    directory = Path(directory) if directory is not None else checkpoint.directory
    files = sorted({src.path for src in checkpoint.tensors.values()})
    # the checkpoint's name without a shard's "-00001-of-00003"
    stem = re.sub(r"-\d+-of-\d+$", "", files[0].name.split(".")[0]) if files else "model"
    data, header = paths(directory, stem, codec)
    key = {"format": FORMAT, "codec": codec, "files": [_file_key(f) for f in files]}
    found = _read(data, header, key, codec)
    if found is not None:
        return found
    return _write(data, header, key, codec, checkpoint)


def _coded(src: Any) -> bool:
    return src.dtype == torch.bfloat16 and src.nbytes // 2 >= coded.MIN_CODED_VALUES


def _layout(entry: list[Any], codec: str) -> Any:
    """A tensor's layout from its entry: its counts are escapes and tier-2 groups (``fixed``,
    ``tiered``) or, for ``huffman``, ``(symbols, segments)`` per range in the escapes' place."""
    _, _, nbytes, bf16, counts, groups, _ = entry
    if codec == "huffman":
        ranges = [[tuple(r) for r in chunk] for chunk in counts]
        return _native.layout_coded_unit_huffman([(0, nbytes, bf16)], [ranges], 1 << 62)
    return _native.layout_coded_unit([(0, nbytes, bf16)], [counts], 1 << 62, [groups] if groups is not None else None)


def _counts(codec: str, t: torch.Tensor, values: int) -> tuple[list[Any], list[Any] | None]:
    """What an entry keeps of a bf16 tensor's counts (:func:`_layout` makes its layout from them)."""
    if codec == "huffman":
        return _native.codec_count_huffman([(t.data_ptr(), values)])[0], None
    esc, grp = coded._count(codec, [(t.data_ptr(), values)])
    return esc[0], (grp[0] if grp is not None else None)


def _read(data: Path, header: Path, key: dict[str, Any], codec: str) -> SideFile | None:
    try:
        meta = json.loads(header.read_text())
        stamp = _stamp(data)
        if meta.get("key") != key or meta.get("stamp") != list(stamp):
            return None
        blobs = {}
        for entry in meta["tensors"]:
            layout = _layout(entry, codec)
            if layout.nbytes != entry[-1][1]:
                return None
            blobs[(entry[0], entry[1])] = Blob(entry[-1][0], layout)
    except (OSError, ValueError, KeyError, TypeError, IndexError, ConfigError):
        return None  # unreadable or from another version: coded again
    return SideFile(data, codec, blobs, True, 0.0, stamp)


def _groups(sources: list[Any]) -> list[list[Any]]:
    out: list[list[Any]] = [[]]
    size = 0
    for src in sources:
        if out[-1] and size + src.nbytes > GROUP_BYTES:
            out.append([])
            size = 0
        out[-1].append(src)
        size += src.nbytes
    return out


def _write(data: Path, header: Path, key: dict[str, Any], codec: str, checkpoint: Any) -> SideFile:
    t0 = time.perf_counter()
    tmp = data.with_name(f"{data.name}.tmp-{os.getpid()}")
    sources = sorted(checkpoint.tensors.values(), key=lambda t: (str(t.path), t.offset))
    entries: list[list[Any]] = []
    blobs: dict[tuple[str, int], Blob] = {}
    try:
        f = open(tmp, "wb")  # noqa: SIM115 (closed by the with below; its failure has its own message)
    except OSError as exc:
        raise ConfigError(
            f"route='nvme' with codec={codec!r} writes its coded side file next to the checkpoint, and {data.parent} "
            f"is not writable ({exc}); pass codec_dir='<a writable directory>' or codec='off'"
        ) from exc
    try:
        with f, _progress(sum(t.nbytes for t in sources), f"coding to {data.name}") as bar:
            offset = 0
            for group in _groups(sources):
                bufs = [torch.empty(src.nbytes, dtype=torch.uint8) for src in group]
                by_file: dict[Path, list[tuple[int, int, int]]] = defaultdict(list)
                for src, t in zip(group, bufs):
                    by_file[src.path].append((src.offset, src.nbytes, t.data_ptr()))
                for path, jobs in by_file.items():
                    _native.read_file_into(path, jobs)  # parallel positional reads
                for src, t in zip(group, bufs):
                    bf16 = _coded(src)
                    if bf16:
                        escapes, groups = _counts(codec, t, src.nbytes // 2)
                    else:
                        escapes, groups = [], ([] if codec == "tiered" else None)
                    entry = [src.path.name, src.offset, src.nbytes, bf16, escapes, groups]
                    layout = _layout([*entry, None], codec)
                    _, buf = _alloc(layout.nbytes)
                    _native.codec_encode_unit(layout, [(t.data_ptr(), src.nbytes)], buf.data_ptr())
                    f.seek(offset)
                    f.write(memoryview(buf.numpy()))
                    entries.append([*entry, [offset, layout.nbytes]])
                    blobs[(src.path.name, src.offset)] = Blob(offset, layout)
                    offset = -(-(offset + layout.nbytes) // BLOB_ALIGN) * BLOB_ALIGN
                    bar.update(src.nbytes)
            f.truncate(-(-max(offset, 1) // ALIGN) * ALIGN)
        os.replace(tmp, data)
        stamp = _stamp(data)
        side = header.with_name(f"{header.name}.tmp-{os.getpid()}")
        side.write_text(json.dumps({"key": key, "stamp": list(stamp), "tensors": entries}))
        os.replace(side, header)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return SideFile(data, codec, blobs, False, time.perf_counter() - t0, stamp)


RESERVE_SLACK = 0.03
"""The staging buffer's reserve over the largest unit's estimated coded size (escapes and tier-2 codes
above the estimate's); a unit whose coded size exceeds it is read as stored."""


def nvme_codec(codec: str, device: torch.device) -> str:
    """The code the NVMe route uses for ``codec``: ``lossless`` is the smallest code whose kernel passed
    its check on this device (the disk, 2-14 GB/s, is the bound, and every decode runs at hundreds of
    GB/s): ``huffman``, else ``tiered``, else ``fixed``."""
    if codec != "lossless":
        return codec
    for code in ("huffman", "tiered"):
        if device.type != "cuda" or coded.planning_rate(device, code) is not None:
            return code
    return "fixed"


def reserve_bytes(module: torch.nn.Module, codec: str, device: torch.device) -> int:
    """Device bytes the NVMe route's coded reads need beside the slots: the staging buffer of the
    largest unit coded (its estimate, :data:`RESERVE_SLACK` over it)."""
    if codec == "off" or device.type != "cuda":
        return 0
    from ..units import split_units

    code = nvme_codec(codec, device)
    # a unit's staging buffer holds its tensors' blobs, each starting at a multiple of BLOB_ALIGN
    est = max((sum(-(-n // BLOB_ALIGN) * BLOB_ALIGN for n in coded.coded_estimate([[p] for _, p in u.params], code))
               for u in split_units(module)[0]), default=0)
    return -(-int(est * (1 + RESERVE_SLACK)) // ALIGN) * ALIGN
