"""The staging ring alone (``low_ram_safe``'s path): pageable host units through the ring of page-locked
buffers into GPU slots, in the engine's order (fetch ahead into K slots; acquire, compute, release,
fetch the next), without a model. Sweeps the ring's shape (buffers, buffer size, copy threads, piece
size of a buffer's parallel fill) with and without a busy main thread, and prints each shape's
rate next to the link and the host copy measured alone in the same process:

    python -m benchmarks.staging --out "$OUT/staging"

The compute of a unit is a GPU sleep (``--compute-ms``) and the host work of launching it a spin of
the main thread (``--busy-ms``), which holds a core as the eager forward's Python does. Needs CUDA.
Writes ``staging.json`` and ``staging.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _units(text: str) -> list[int]:
    """``"6x648,12x270"`` -> unit sizes in bytes, in order (a Flux-like run of double then single blocks)."""
    sizes: list[int] = []
    for part in text.split(","):
        count, _, mib = part.partition("x")
        sizes += [int(float(mib) * (1 << 20)) // 4096 * 4096] * int(count)
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.staging", description=__doc__.split("\n\n")[0])
    p.add_argument("--units", default="6x648,12x270", help="unit sizes, COUNTxMIB,... (default 6x648,12x270)")
    p.add_argument("--source-gib", type=float, default=4.0, help="pageable source the units cycle over (default 4)")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--buffers", type=_ints, default=[2, 4, 8])
    p.add_argument("--buffer-mib", type=_ints, default=[32, 64, 128])
    p.add_argument("--threads", type=_ints, default=[12, 14, 16])
    p.add_argument("--piece-mib", type=_floats, default=[0, 1], help="0: an even share per thread")
    p.add_argument("--busy-ms", type=_floats, default=[0, 2], help="main-thread spin per unit")
    p.add_argument("--compute-ms", type=float, default=3.0, help="GPU work per unit (default 3)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from ddo_blocks import _native
    from ddo_blocks.streaming.slabs import PinnedBuffer, _alloc

    if _native.cuda_unavailable_reason() is not None or not torch.cuda.is_available():
        print(f"needs CUDA: {_native.cuda_unavailable_reason() or 'torch sees no GPU'}", file=sys.stderr)
        return 2
    units = _units(args.units)
    source_bytes = max(int(args.source_gib * (1 << 30)), max(units) * 2)
    _, src = _alloc(source_bytes)
    src.fill_(7)  # pageable and touched, as the engine's slabs are
    offsets, at = [], 0
    for n in units:
        if at + n > source_bytes:
            at = 0
        offsets.append(at)
        at += n
    total = sum(units)
    slots = [torch.empty(max(units), dtype=torch.uint8, device="cuda") for _ in range(args.slots)]
    compute, copy = torch.cuda.Stream(), torch.cuda.Stream()
    cycles_per_ms = _sleep_rate(torch)

    def spin(ms: float) -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass

    def one_pass(t: object, busy_ms: float) -> float:
        k = args.slots
        torch.cuda.synchronize()
        start = time.perf_counter()
        for j in range(min(k, len(units))):
            t.fetch(j, slots[j].data_ptr(), src.data_ptr() + offsets[j], units[j])
        for j in range(len(units)):
            s = j % k
            t.acquire(s, compute.cuda_stream)
            with torch.cuda.stream(compute):
                torch.cuda._sleep(int(args.compute_ms * cycles_per_ms))
            spin(busy_ms)
            t.release(s, compute.cuda_stream)
            if j + k < len(units):
                t.fetch(s, slots[s].data_ptr(), src.data_ptr() + offsets[j + k], units[j + k])
        t.drain()
        compute.synchronize()
        return time.perf_counter() - start

    # the references, alone
    with PinnedBuffer(1 << 30, 0) as pinned:
        dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dev.copy_(pinned.tensor, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            dev.copy_(pinned.tensor, non_blocking=True)
        torch.cuda.synchronize()
        link = 4 * (1 << 30) / (time.perf_counter() - t0) / 1e9
        part = (1 << 30) // 16  # 16 jobs on rayon's global pool (one thread per core)
        jobs = [(pinned.tensor.data_ptr() + i * part, src.data_ptr() + i * part, part) for i in range(16)]
        _native.copy_host_many(jobs)
        t0 = time.perf_counter()
        for _ in range(3):
            _native.copy_host_many(jobs)
        host = 3 * (1 << 30) / (time.perf_counter() - t0) / 1e9
        del dev
    compute_s = len(units) * args.compute_ms / 1e3
    print(f"link alone {link:.1f} GB/s, host copy alone ({os.cpu_count()} threads) {host:.1f} GB/s; {len(units)} units, "
          f"{total / 1e9:.2f} GB a pass, compute {compute_s:.3f} s a pass; {os.cpu_count()} CPUs", flush=True)

    rows = []
    grid = itertools.product(args.buffers, args.buffer_mib, args.threads, args.piece_mib, args.busy_ms)
    for buffers, mib, threads, piece, busy in grid:
        t = _native.Transport("cuda", 0, args.slots, copy.cuda_stream, (buffers, mib << 20, threads, True),
                              piece_bytes=int(piece * (1 << 20)))
        try:
            one_pass(t, busy)  # warm
            waited0 = t.stats()[2]
            times = [one_pass(t, busy) for _ in range(args.repeats)]
            waited = (t.stats()[2] - waited0) / args.repeats
        finally:
            t.close()
        best = min(times)
        row = {"buffers": buffers, "buffer_mib": mib, "threads": threads, "piece_mib": piece, "busy_ms": busy,
               "pass_s": best, "gb_s": total / best / 1e9, "host_wait_s": waited,
               "bound_s": max(compute_s, total / (min(link, host) * 1e9))}
        rows.append(row)
        print(f"{buffers} x {mib:4d} MiB, {threads:2d} threads, piece {piece:g} MiB, busy {busy:g} ms: "
              f"{row['gb_s']:5.1f} GB/s, pass {best:.3f} s ({best / row['bound_s']:.2f}x of its bound), "
              f"acquire waits {waited:.3f} s", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python -m benchmarks.staging " + " ".join(argv if argv is not None else sys.argv[1:]),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gpu": torch.cuda.get_device_name(),
                "cpus": os.cpu_count(), "link_gb_s": link, "host_copy_gb_s": host, "units": len(units),
                "pass_bytes": total, "compute_ms": args.compute_ms, "slots": args.slots, "rows": rows}
        (args.out / "staging.json").write_text(json.dumps(meta, indent=1))
        lines = [f"# Staging ring sweep: {meta['gpu']}, {meta['cpus']} CPUs", "",
                 f"- command: `{meta['command']}`", f"- link alone {link:.1f} GB/s, host copy alone {host:.1f} GB/s",
                 "", "| buffers | MiB | threads | piece MiB | busy ms | GB/s | x bound | acquire waits s |",
                 "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['buffers']} | {r['buffer_mib']} | {r['threads']} | {r['piece_mib']:g} | {r['busy_ms']:g} | "
                  f"{r['gb_s']:.1f} | {r['pass_s'] / r['bound_s']:.2f} | {r['host_wait_s']:.3f} |" for r in rows]
        (args.out / "staging.md").write_text("\n".join(lines) + "\n")
    return 0


def _sleep_rate(torch: object) -> float:
    """GPU sleep cycles per millisecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


if __name__ == "__main__":
    sys.exit(main())
