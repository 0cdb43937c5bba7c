"""Does the pageable-to-pinned host copy (the ``low_ram_safe`` staging ring's fill) keep its rate while
the link's DMA reads host memory at the same time? ``low_ram_safe``'s bound assumes the two rates
are independent (``max(compute, streamed / min(link, host copy))``); its steps sit at 1.29-1.37x of
that bound. This measures each rate alone and both at once.

    python -m benchmarks.host_contention --gib 2 --threads 16

Needs CUDA. Prints decimal GB/s; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="buffer size in GiB (default 2)")
    p.add_argument("--threads", type=int, default=16, help="parallel host copies (default 16)")
    args = p.parse_args(argv)

    import torch

    from ddo_blocks import _native
    from ddo_blocks.streaming.slabs import PinnedBuffer

    if _native.cuda_unavailable_reason() is not None or not torch.cuda.is_available():
        print(f"needs CUDA: {_native.cuda_unavailable_reason() or 'torch sees no GPU'}", file=sys.stderr)
        return 2
    n = int(args.gib * (1 << 30)) // args.threads * args.threads
    part = n // args.threads
    src = torch.ones(n, dtype=torch.uint8)  # pageable, touched
    with PinnedBuffer(n, 0) as dst, PinnedBuffer(n, 0) as dma_src:
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        jobs = [(dst.tensor.data_ptr() + i * part, src.data_ptr() + i * part, part) for i in range(args.threads)]

        def host_copy(reps: int) -> float:
            t = time.perf_counter()
            for _ in range(reps):
                _native.copy_host_many(jobs)
            return reps * n / (time.perf_counter() - t) / 1e9

        def h2d(reps: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                for _ in range(reps):
                    dev.copy_(dma_src.tensor, non_blocking=True)
                end.record(stream)
            return start, end

        def rate(events: tuple[torch.cuda.Event, torch.cuda.Event], reps: int) -> float:
            events[1].synchronize()
            return reps * n / (events[0].elapsed_time(events[1]) / 1e3) / 1e9

        host_copy(1)
        alone_host = host_copy(3)
        alone_link = rate(h2d(6), 6)
        ev = h2d(12)  # long enough to cover the host copies below
        during_host = host_copy(4)
        during_link = rate(ev, 12)
    print(f"host copy alone ({args.threads} parallel copies): {alone_host:.1f} GB/s")
    print(f"host-to-device alone: {alone_link:.1f} GB/s")
    print(f"host copy while the link copies: {during_host:.1f} GB/s; the link over the same window and after: "
          f"{during_link:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
