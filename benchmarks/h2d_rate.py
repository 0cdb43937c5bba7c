"""Host-to-device copy rate by where the host bytes live and what the GPU does meanwhile: why the
codec's chunk copies ran at 52.9 GB/s where the uncompressed route's ran at 55.3 on the H200.

    python -m benchmarks.h2d_rate --out "$OUT/h2d"

Each row copies the same bytes in 48 MiB copies from page-locked memory (``_native.HostRegistration``,
as the engine pins) into a device buffer on one stream and times them with CUDA events:

- ``slab``: one 1 GiB buffer, as the uncompressed route's slabs;
- ``units``: separate buffers of 400 MiB, as the codec's per-unit buffers;
- ``units_threads``: the same, first written by 8 threads (the encoder's rayon pool);
- ``slab_busy``: the slab while a device-to-device copy streams 2 x 4 GiB on another stream (the
  driver's copy, which may run on a copy engine);
- ``slab_sm_busy``: the slab while an elementwise kernel on the SMs (``torch.add`` of 2 GiB bf16
  tensors) reads and writes device memory on another stream, as the codec's decode kernels do;
- ``slab_gemm_busy``: the slab while bf16 GEMMs (8192 x 8192 x 8192, cuBLAS) run on another stream, as
  the model's linear layers do beside the copies;
- ``slab_attn_busy``: the slab while attention (``scaled_dot_product_attention``, Flux's 24 heads of
  128 over 4608 tokens) runs on another stream;
- ``units_4k`` / ``units_thp``: 400 MiB buffers of anonymous memory advised ``MADV_NOHUGEPAGE`` /
  ``MADV_HUGEPAGE`` before they are touched (4 KiB pages against 2 MiB ones: the GPU maps page-locked
  host memory with the pages it is given);
- ``units_scattered``: 4 KiB-page buffers whose pages were freed a moment before one in every two
  (so the kernel hands out physically scattered pages, as after a model's weights are freed while
  its coded copy is written);
- ``slab_12m``: the slab in 12 MiB copies (one coded chunk of 8 Mi values at 12 bits);
- ``ring``: 12 MiB copies into a ring of 34 landing buffers, as the codec's copies (no waits);
- ``ring_consumed``: the same, each buffer consumed on a high-priority stream as the codec's decode
  does (a kernel reads it and writes twice its bytes into a slot region), the copy into a buffer
  waiting for its last consumer's event and the consumer for its copy's event.

Writes ``h2d_rate.json``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import threading
import time
from pathlib import Path

PAGE = mmap.PAGESIZE


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.h2d_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="bytes per row (default 4 GiB)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from ddo_blocks import _native

    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    piece = 48 << 20
    total = int(args.gib * (1 << 30)) // piece * piece
    dst = torch.empty(piece * 4, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)

    def pinned(nbytes: int, threads: int = 1) -> tuple[torch.Tensor, object]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if threads == 1:
            buf.fill_(1)
        else:
            step = -(-nbytes // threads)
            ts = [threading.Thread(target=buf[i * step:(i + 1) * step].fill_, args=(1,)) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        return buf, _native.HostRegistration(buf, buf.data_ptr(), nbytes, dev.index)

    def gemms() -> None:
        x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        for _ in range(120):
            torch.mm(x, x)

    def attention() -> None:
        q = torch.randn(1, 24, 4608, 128, dtype=torch.bfloat16, device=dev)
        for _ in range(300):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)

    def advised(nbytes: int, advice: int) -> tuple[torch.Tensor, object, object]:
        m = mmap.mmap(-1, nbytes)
        m.madvise(advice)
        buf = torch.frombuffer(m, dtype=torch.uint8)
        buf.fill_(1)
        return buf, _native.HostRegistration(buf, buf.data_ptr(), nbytes, dev.index), m

    def rate(buffers: list[torch.Tensor], busy: bool = False, sm: bool = False, load: object = None) -> float:
        a = b = None
        if busy or sm:
            a = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
            b = torch.empty_like(a)
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if busy:
                with torch.cuda.stream(side):
                    for _ in range(40):
                        b.copy_(a)
            if sm:
                fa, fb = a.view(torch.bfloat16), b.view(torch.bfloat16)
                with torch.cuda.stream(side):
                    for _ in range(60):
                        torch.add(fa, 1, out=fb)
            if callable(load):
                with torch.cuda.stream(side):
                    load()
            start.record(stream)
            k = 0
            for buf in buffers:
                for off in range(0, buf.numel() - piece + 1, piece):
                    dst[(k % 4) * piece:(k % 4 + 1) * piece].copy_(buf[off:off + piece], non_blocking=True)
                    k += 1
            end.record(stream)
        torch.cuda.synchronize(dev)
        return k * piece / (start.elapsed_time(end) / 1e3) / 1e9

    def ring_rate(buffers: list[torch.Tensor], consumed: bool, chunk: int = 12 << 20, n: int = 34) -> float:
        """``chunk`` copies into a ring of ``n`` buffers; ``consumed``: a high-priority stream reads
        each buffer after its copy (and writes 2x its bytes elsewhere), the next copy into that buffer
        waits for it, as the codec's landing ring and decode stream do."""
        ring = torch.empty(n * chunk, dtype=torch.uint8, device=dev)
        slot = torch.empty(2 * n * chunk, dtype=torch.uint8, device=dev)
        decode = torch.cuda.Stream(dev, priority=-1)
        copied = [torch.cuda.Event() for _ in range(n)]
        freed: list[torch.cuda.Event | None] = [None] * n
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        k = 0
        for buf in buffers:
            for off in range(0, buf.numel() - chunk + 1, chunk):
                b = k % n
                with torch.cuda.stream(stream):
                    if consumed and freed[b] is not None:
                        stream.wait_event(freed[b])
                    ring[b * chunk:(b + 1) * chunk].copy_(buf[off:off + chunk], non_blocking=True)
                    copied[b].record(stream)
                if consumed:
                    with torch.cuda.stream(decode):
                        decode.wait_event(copied[b])
                        src = ring[b * chunk:(b + 1) * chunk].view(torch.bfloat16)
                        out = slot[2 * b * chunk:2 * (b + 1) * chunk].view(torch.bfloat16)
                        out[: src.numel()].copy_(src)
                        out[src.numel():].copy_(src)
                        ev = torch.cuda.Event()
                        ev.record(decode)
                        freed[b] = ev
                k += 1
        end.record(stream)
        torch.cuda.synchronize(dev)
        return k * chunk / (start.elapsed_time(end) / 1e3) / 1e9

    rows = {}
    slab, reg = pinned(1 << 30)
    n12 = int(total // (1 << 30))
    rows["slab_12m"] = max(ring_rate([slab] * n12, False, n=4) for _ in range(3))
    rows["ring"] = max(ring_rate([slab] * n12, False) for _ in range(3))
    rows["ring_consumed"] = max(ring_rate([slab] * n12, True) for _ in range(3))
    rows["slab"] = max(rate([slab] * int(total // (1 << 30))) for _ in range(3))
    rows["slab_busy"] = max(rate([slab] * int(total // (1 << 30)), busy=True) for _ in range(2))
    rows["slab_sm_busy"] = max(rate([slab] * int(total // (1 << 30)), sm=True) for _ in range(2))
    rows["slab_gemm_busy"] = max(rate([slab] * int(total // (1 << 30)), load=gemms) for _ in range(2))
    rows["slab_attn_busy"] = max(rate([slab] * int(total // (1 << 30)), load=attention) for _ in range(2))
    del reg
    unit = 400 << 20
    units = [pinned(unit) for _ in range(max(1, total // unit))]
    rows["units"] = max(rate([u for u, _ in units]) for _ in range(3))
    del units
    units = [pinned(unit, threads=8) for _ in range(max(1, total // unit))]
    rows["units_threads"] = max(rate([u for u, _ in units]) for _ in range(3))
    del units
    for name, advice in (("units_4k", mmap.MADV_NOHUGEPAGE), ("units_thp", mmap.MADV_HUGEPAGE)):
        held = [advised(unit, advice) for _ in range(max(1, total // unit))]
        rows[name] = max(rate([u for u, _, _ in held]) for _ in range(3))
        del held
    # free every other page of a touched 4 KiB-page mapping, then take buffers from those pages
    sieve = mmap.mmap(-1, 2 * (1 << 30))
    sieve.madvise(mmap.MADV_NOHUGEPAGE)
    torch.frombuffer(sieve, dtype=torch.uint8).fill_(1)
    for off in range(0, len(sieve), 2 * PAGE):
        sieve.madvise(mmap.MADV_DONTNEED, off, PAGE)
    held = [advised(unit, mmap.MADV_NOHUGEPAGE) for _ in range(max(1, (1 << 30) // unit))]
    rows["units_scattered"] = max(rate([u for u, _, _ in held] * max(1, total // (1 << 30))) for _ in range(3))
    del held
    thp = {}
    for knob in ("enabled", "defrag"):
        try:
            thp[knob] = Path(f"/sys/kernel/mm/transparent_hugepage/{knob}").read_text().strip()
        except OSError as exc:
            thp[knob] = f"unreadable: {exc}"
    doc = {"command": "python -m benchmarks.h2d_rate " + " ".join(argv if argv is not None else sys.argv[1:]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": torch.cuda.get_device_name(dev),
           "copy_bytes": piece, "transparent_hugepage": thp, "gb_per_s": rows}
    print(json.dumps(doc, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "h2d_rate.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
