"""Host rate of the codecs' encoders against a plain copy: what the coded setup pays per byte.

    python -m benchmarks.encode_rate --units 8 --out "$OUT/encode"

Builds ``--units`` units shaped like a Flux double block's children (four 3072 x 3072 and a
3072 x 12288 and 12288 x 3072 bf16 weight, 226 MB a unit, random normal x 0.02) and times, per unit,
with the process's rayon pool (``RAYON_NUM_THREADS``, default one thread a core):

- ``copy``: ``torch`` copies the unit's tensors into one host buffer (the uncompressed route's pack);
- ``count``: the code's counts alone (``codec_count_*``);
- ``fused``: ``codec_encode_unit_fused``, the count and the code in one call (the coded route's setup);

each into ``fresh`` buffers (allocated per unit as the route allocates them, so the first touch of
every page is timed) and into ``warm`` ones (touched before). Writes ``encode_rate.json``; rates are
GB/s of bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SHAPES = [(3072, 3072)] * 4 + [(12288, 3072), (3072, 12288)]
PAGE = 4096


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.encode_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=8)
    p.add_argument("--codecs", default="fixed,tiered,huffman")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from ddo_blocks import _native

    gen = torch.Generator().manual_seed(0)
    units = [[(torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for s in SHAPES] for _ in range(args.units)]
    nbytes = sum(t.numel() * 2 for t in units[0])
    specs, off = [], 0
    for t in units[0]:
        specs.append((off, t.numel() * 2, True))
        off += t.numel() * 2
    capacity = _native.codec_capacity(specs)

    def fresh() -> tuple[torch.Tensor, int]:
        storage = torch.empty(capacity + PAGE, dtype=torch.uint8)
        return storage, storage.data_ptr() + (-storage.data_ptr()) % PAGE

    warm_storage, warm_ptr = fresh()
    warm_storage.fill_(0)

    def run(what: str, codec: str | None, where: str) -> float:
        keep = []
        t0 = time.perf_counter()
        for unit in units:
            storage, ptr = fresh() if where == "fresh" else (warm_storage, warm_ptr)
            keep.append(storage)
            srcs = [(t.data_ptr(), t.numel() * 2) for t in unit]
            if what == "copy":
                flat = storage[ptr - storage.data_ptr():][:nbytes]
                o = 0
                for t in unit:
                    flat[o:o + t.numel() * 2].copy_(t.view(-1).view(torch.uint8))
                    o += t.numel() * 2
            elif what == "count":
                count = {"fixed": _native.codec_count_escapes, "tiered": _native.codec_count_tiered,
                         "huffman": _native.codec_count_huffman}[codec]
                count([(a, n // 2) for a, n in srcs])
            else:
                _native.codec_encode_unit_fused(specs, srcs, codec, 1 << 62, ptr, capacity)
        dt = time.perf_counter() - t0
        del keep
        return nbytes * len(units) / dt / 1e9

    rows: dict[str, float] = {}
    for where in ("fresh", "warm"):
        rows[f"copy/{where}"] = max(run("copy", None, where) for _ in range(args.repeats))
    for codec in args.codecs.split(","):
        rows[f"{codec}/count"] = max(run("count", codec, "warm") for _ in range(args.repeats))
        for where in ("fresh", "warm"):
            rows[f"{codec}/fused/{where}"] = max(run("fused", codec, where) for _ in range(args.repeats))
        print(codec, {k: round(v, 2) for k, v in rows.items() if k.startswith(codec)}, flush=True)
    doc = {"command": "python -m benchmarks.encode_rate " + " ".join(argv if argv is not None else sys.argv[1:]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
           "rayon_threads": os.environ.get("RAYON_NUM_THREADS"), "unit_bytes": nbytes, "units": args.units,
           "gb_per_s": rows}
    print(json.dumps(doc, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "encode_rate.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
