"""Fast-loading benchmark: ``ddo_blocks.from_pretrained`` against a plain sequential read of the same
safetensors files, page cache dropped before each, every phase in its own process.

    python -m benchmarks.loading --device cuda --out-root "$OUT"      # Flux-dev-sized, 22 GiB
    python -m benchmarks.loading --device cpu --tiny --out /tmp/load  # seconds, on any machine

Phases: (1) build the model (random weights), compute a reference forward, ``save_pretrained`` it
(diffusers' default sharding); (2) ``sync`` and drop the files from the page cache
(``posix_fadvise(DONTNEED)``); (3) read every file sequentially in 64 MiB chunks into one reused
buffer: the disk's own time; (4) drop the cache again; (5) ``from_pretrained`` into the linear route
at the given budget: time from call to ready, peak host RSS (10 ms sampler and ``ru_maxrss``), then a
forward checked with ``torch.equal`` against the reference. Results: JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.measure import GIB, RssSampler, parse_size, sync

CHUNK = 64 << 20


def _drop_cache(directory: Path, pattern: str = "*.safetensors") -> None:
    os.sync()
    for f in sorted(directory.glob(pattern)):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def phase_save(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.model import FLUX_DEV, TINY, random_model
    from ddo_blocks.tiny import flux_inputs

    dev = torch.device(args.device)
    cfg = TINY if args.tiny else FLUX_DEV
    t0 = time.perf_counter()
    model = random_model(cfg, dev)
    x = flux_inputs(model, height=args.tokens_side, width=args.tokens_side, text_len=args.text_tokens, device=dev)
    with torch.no_grad():
        ref = model(**x)[0].cpu()
    build_s = time.perf_counter() - t0
    out = Path(args.dir)
    t0 = time.perf_counter()
    model.save_pretrained(out)
    torch.save({"inputs": {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}, "ref": ref},
               out / "reference.pt")
    save_s = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"build_s": build_s, "save_s": save_s, "weight_bytes": weights,
            "files": sorted(f.name for f in out.glob("*.safetensors*"))}


def phase_read(args: argparse.Namespace) -> dict[str, Any]:
    files = sorted(Path(args.dir).glob("*.safetensors"))
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    secs = time.perf_counter() - t0
    return {"seq_read_s": secs, "seq_read_bytes": total, "seq_read_gb_s": total / secs / 1e9}


def phase_load(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from diffusers import FluxTransformer2DModel

    import ddo_blocks

    sampler = RssSampler().start()
    t0 = time.perf_counter()
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, args.dir, route="linear", preset=args.preset,
                                        vram_budget=args.budget, device=args.device, component="transformer")
    sync(args.device)
    ready_s = time.perf_counter() - t0
    rss = sampler.stop()
    saved = torch.load(Path(args.dir) / "reference.pt")
    x = {k: (v.to(args.device) if isinstance(v, torch.Tensor) else v) for k, v in saved["inputs"].items()}
    with torch.no_grad():
        outs = [handle.module(**x)[0].cpu() for _ in range(2)]
    exact = all(torch.equal(o, saved["ref"]) for o in outs)
    report = handle.report().to_dict()
    handle.remove()
    return {
        "ready_s": ready_s,
        "bytes_read": getattr(handle, "setup_bytes_read", None),
        "peak_rss": rss.peak,
        "rss_before": rss.start,
        "pinned_bytes": report["memory"]["pinned_bytes"],
        "streamed_bytes": report["plan"].get("streamed_bytes"),
        "exact": exact,
    }


PHASES = {"save": phase_save, "read": phase_read, "load": phase_load}


def _child(phase: str, argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.loading", "--phase", phase, *argv],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loading", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny Flux config (CPU smoke)")
    p.add_argument("--dir", default="/tmp/ddo-loading-model", help="where the model is saved (local disk)")
    p.add_argument("--budget", default="8GiB", help="vram_budget for from_pretrained (default 8GiB)")
    p.add_argument("--preset", default="one_shot_fast")
    p.add_argument("--tokens-side", type=int, default=None, help="latent tokens per side (default 64; --tiny 8)")
    p.add_argument("--text-tokens", type=int, default=None, help="text tokens (default 512; --tiny 12)")
    p.add_argument("--out", default=None, help="output folder (default: <out-root>/<date>-<machine>-loading)")
    p.add_argument("--out-root", default="benchmarks/results")
    p.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.tokens_side = args.tokens_side or (8 if args.tiny else 64)
    args.text_tokens = args.text_tokens or (12 if args.tiny else 512)
    if args.tiny and args.budget == "8GiB":
        args.budget = "0.5x"
    if args.phase:
        total = sum(f.stat().st_size for f in Path(args.dir).glob("*.safetensors"))
        args.budget = parse_size(args.budget, total, bare_unit="B")  # vram_budget's own reading
        print(json.dumps(PHASES[args.phase](args)))
        return 0
    child_argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    saved = _child("save", child_argv)
    _drop_cache(Path(args.dir))
    read = _child("read", child_argv)
    _drop_cache(Path(args.dir))
    load = _child("load", child_argv)
    weights = saved["weight_bytes"]
    doc = {
        "schema": "ddo_blocks.bench.loading/1",
        "date": date.today().isoformat(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count()},
        "command": "python -m benchmarks.loading " + " ".join(child_argv),
        "save": saved,
        "read": read,
        "load": load,
        "ratio_ready_to_seq_read": load["ready_s"] / read["seq_read_s"],
        "ratio_peak_rss_to_weights": load["peak_rss"] / weights,
        "wall_s": time.perf_counter() - t0,
    }
    if args.device.startswith("cuda"):
        import torch

        doc["machine"]["gpu"] = torch.cuda.get_device_name(0)
    out = Path(args.out) if args.out else Path(args.out_root) / f"{date.today().isoformat()}-{platform.node()}-loading"
    out.mkdir(parents=True, exist_ok=True)
    (out / "loading.json").write_text(json.dumps(doc, indent=2))
    gib = GIB
    md = [
        f"# Loading benchmark, {doc['date']}",
        "",
        f"Command: `{doc['command']}`; files: {', '.join(saved['files'])} ({weights / gib:.2f} GiB of weights).",
        "",
        "| what | seconds | GB/s | peak host RSS GiB | RSS / weights | exact |",
        "|---|---|---|---|---|---|",
        f"| sequential read, 64 MiB chunks, page cache dropped | {read['seq_read_s']:.2f} | {read['seq_read_gb_s']:.2f} | - | - | - |",
        f"| `from_pretrained` ({args.preset}, vram_budget {args.budget}) to ready | {load['ready_s']:.2f} | "
        f"{(load['bytes_read'] or 0) / load['ready_s'] / 1e9:.2f} | {load['peak_rss'] / gib:.2f} | "
        f"{doc['ratio_peak_rss_to_weights']:.2f} | {'yes' if load['exact'] else 'NO'} |",
        "",
        f"Ready / sequential read: **{doc['ratio_ready_to_seq_read']:.2f}x**. The load's peak RSS includes the "
        f"process's own {load['rss_before'] / gib:.2f} GiB before the call.",
    ]
    (out / "loading.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out}/loading.json and loading.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
