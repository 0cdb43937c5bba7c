"""The NVMe route's read pipeline against the disk, without a model: seconds, on any machine.

    python -m benchmarks.readpipe --out benchmarks/results/<date>-<machine>-readpipe

One scratch file (``--file-gib``, written once with random bytes, next to ``--dir``) is cut into
units of ``--unit-mib`` at odd offsets, like tensors in a safetensors file. The transport (CPU target,
``--slots`` slots, the NVMe preset's ring of 4 x 64 MiB and ``--readers`` readers) fetches every unit
in turn, the way the engine does (acquire, release, fetch the unit ``slots`` ahead), with the page
cache dropped first. Reported per repeat: the pipeline's GB/s, the route's own disk probe over the
same file (``O_DIRECT``, one long read), and the fraction of the time the disk was busy with reads
and its mean queue depth (``/proc/diskstats`` of the file's block device, when it has one). A busy
fraction below 1 while the pipeline lags the probe means the pipeline left the disk idle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.loading import _drop_cache

MiB = 1 << 20
GiB = 1 << 30


def block_device(path: Path) -> str | None:
    """The ``/proc/diskstats`` name of the block device holding ``path`` (None for overlay/tmpfs)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if int(f[0]) == major and int(f[1]) == minor:
                return f[2]
    except OSError:
        return None
    return None


def disk_ticks(device: str | None) -> tuple[int, int] | None:
    """Milliseconds the device was busy and weighted milliseconds of its queue, since boot."""
    if device is None:
        return None
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] == device:
            return int(f[12]), int(f[13])
    return None


def busy(t0: tuple[int, int] | None, t1: tuple[int, int] | None, seconds: float) -> dict[str, float | None]:
    if t0 is None or t1 is None or seconds <= 0:
        return {"disk_busy": None, "queue_depth": None}
    return {"disk_busy": (t1[0] - t0[0]) / 1e3 / seconds, "queue_depth": (t1[1] - t0[1]) / 1e3 / seconds}


def scratch_file(directory: Path, nbytes: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "readpipe.bin"
    if not path.is_file() or path.stat().st_size != nbytes:
        block = os.urandom(64 * MiB)
        with open(path, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.write(block[: nbytes % len(block)])
    return path


def one_pass(path: Path, unit: int, slots: int, readers: int, device: str | None) -> dict[str, Any]:
    import torch

    from ddo_blocks import _native

    size = path.stat().st_size
    _drop_cache(path.parent, path.name)
    bps, nbytes, direct = _native.measure_disk_read(str(path), min(size, 2 * GiB), readers)
    t = _native.Transport("cpu", 0, slots, 0, (4, 64 * MiB, readers, True), stage_host=False)
    try:
        fid = t.open_file(str(path))
        # odd offsets and lengths, like tensors after a safetensors header
        units = [t.add_file_unit([(fid, 144 + k * unit, unit - 4096, 0)], 65536) for k in range(size // unit - 1)]
        dst = torch.empty(slots * unit, dtype=torch.uint8)
        ptr = [dst.data_ptr() + i * unit for i in range(slots)]
        _drop_cache(path.parent, path.name)
        k0 = disk_ticks(device)
        t0 = time.perf_counter()
        for i in range(min(slots, len(units))):
            t.fetch_file(i, ptr[i], units[i])
        for k in range(len(units)):
            s = k % slots
            t.acquire(s, 0)
            t.release(s, 0)
            if k + slots < len(units):
                t.fetch_file(s, ptr[s], units[k + slots])
        t.drain()
        seconds = time.perf_counter() - t0
        k1 = disk_ticks(device)
    finally:
        t.close()
    moved = len(units) * (unit - 4096)
    return {
        "pipeline_gb_s": moved / seconds / 1e9,
        "probe_gb_s": bps / 1e9,
        "probe_bytes": nbytes,
        "direct": bool(direct),
        "units": len(units),
        **busy(k0, k1, seconds),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readpipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/ddo-readpipe", help="where the scratch file lives (a real disk)")
    p.add_argument("--file-gib", type=float, default=3.0)
    p.add_argument("--unit-mib", type=int, default=96, help="unit size (Flux child units average 93 MiB)")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    path = scratch_file(Path(args.dir), int(args.file_gib * GiB))
    device = block_device(path)
    rows = []
    for r in range(args.repeats):
        row = one_pass(path, args.unit_mib * MiB, args.slots, args.readers, device)
        rows.append(row)
        print(f"repeat {r + 1}: pipeline {row['pipeline_gb_s']:.3f} GB/s, probe {row['probe_gb_s']:.3f} GB/s "
              f"(O_DIRECT {row['direct']}), disk busy "
              + (f"{row['disk_busy']:.2f}, queue depth {row['queue_depth']:.1f}" if row["disk_busy"] is not None
                 else "unknown (no block device)"), flush=True)
    doc = {"schema": "ddo_blocks.bench.readpipe/1", "date": date.today().isoformat(), "machine": platform.node(),
           "command": "python -m benchmarks.readpipe " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": device, "args": vars(args), "rows": rows}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "readpipe.json").write_text(json.dumps(doc, indent=2))
        print(f"wrote {out}/readpipe.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
