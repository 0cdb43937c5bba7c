"""Copy and compute timelines of an offloaded forward, from the PyTorch profiler (CUPTI).

    python -m benchmarks.profile --device cuda --budget 12GiB --out "$OUT/profile"

Builds the Flux-dev-sized transformer (random bf16 weights, built on the device, moved to the host),
offloads it with the linear route (``--codec fixed``: coded weights, decoded on the GPU), runs
warm-up calls, then profiles ``--steps`` calls. From the Chrome trace it takes every kernel (compute)
and every host-to-device memcpy (the copy stream) and reports, per profiled call (the codec's decode
kernels in a lane of their own): its span, the link's busy time (bytes / span = achieved GB/s), the
copies' rate by size and by the compute beside them, the compute's busy time, and the time compute
sat idle, split into "while the link was busy" (waiting for a copy, or the link prefetching ahead)
and "with the link idle too" (host-side overhead: launches, hooks). A PNG draws both timelines;
``lanes.json.gz`` keeps every kernel and copy of the trace in a few hundred KB.
This is the profile the roofline issue asks for when a row misses its target.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DECODE_KERNELS = ("ddo_decode12", "ddo_decode_tiered", "ddo_decode_huffman")
"""The codecs' decode kernels (fixed-rate, two-tier, Huffman): their own lane, apart from the model's compute."""


def _intervals(events: list[dict[str, Any]], cats: tuple[str, ...], decode: bool | None = None) -> list[tuple[float, float]]:
    """Intervals of the events of ``cats``; ``decode``: only the decode kernel (True), all but it (False)."""
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
           if e.get("ph") == "X" and e.get("cat") in cats
           and (decode is None or (e.get("name") in DECODE_KERNELS) == decode)]
    return sorted(out)


def _merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in iv:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(iv: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in iv)


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, j = 0.0, 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            total += max(0.0, min(b, y[k][1], hi) - max(a, y[k][0], lo))
            k += 1
    return total


def analyse(trace: dict[str, Any], call_windows: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Per call window (µs, trace clock): span, compute busy, link busy, compute idle, link busy,
    idle with both idle."""
    events = trace.get("traceEvents", [])
    compute = _merge(_intervals(events, ("kernel",), decode=False))
    decodes = _merge(_intervals(events, ("kernel",), decode=True))
    copies = _merge(_intervals(events, ("gpu_memcpy",)))
    rows = []
    for lo, hi in call_windows:
        span = hi - lo
        busy_c = _length(compute, lo, hi)
        busy_l = _length(copies, lo, hi)
        both = _overlap(compute, copies, lo, hi)
        idle_c = span - busy_c
        wait_on_copy = busy_l - both  # link busy while compute idle (waiting for it, or prefetching ahead)
        rows.append({
            "span_s": span / 1e6,
            "compute_busy_s": busy_c / 1e6,
            "link_busy_s": busy_l / 1e6,
            "compute_idle_link_busy_s": wait_on_copy / 1e6,
            "idle_both_s": max(0.0, idle_c - wait_on_copy) / 1e6,
            "decode_busy_s": _length(decodes, lo, hi) / 1e6,
            **_link_detail(events, copies, compute, decodes, lo, hi),
        })
    return rows


def _link_detail(events: list[dict[str, Any]], copies: list[tuple[float, float]], compute: list[tuple[float, float]],
                 decodes: list[tuple[float, float]], lo: float, hi: float) -> dict[str, Any]:
    """Where the link's time goes in one call: its copies by size (count, bytes, busy time, GB/s
    while busy) and its idle gaps (count, total, and what ran on the SMs during them)."""
    sizes: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "gpu_memcpy" or not lo <= float(e["ts"]) < hi:
            continue
        nbytes = float((e.get("args") or {}).get("bytes", 0))
        band = "<1MiB" if nbytes < 1 << 20 else "1-8MiB" if nbytes < 8 << 20 else "8-64MiB" if nbytes < 64 << 20 else ">=64MiB"
        row = sizes.setdefault(band, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += nbytes
        row[2] += float(e.get("dur", 0))
    # the copies' rate by how much compute ran beside them (the coded route's copies ran at 52 GB/s
    # beside compute and 54.5 without on the H200, where the uncompressed route's ran at 54.5 either way)
    beside: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "gpu_memcpy" or not lo <= float(e["ts"]) < hi:
            continue
        nbytes, dur = float((e.get("args") or {}).get("bytes", 0)), float(e.get("dur", 0))
        if nbytes < 1 << 20 or dur <= 0:
            continue
        a = float(e["ts"])
        share = _length(compute, a, a + dur) / dur
        row = beside.setdefault("compute_over_half" if share > 0.5 else "compute_under_half", [0, 0.0, 0.0])
        row[0] += 1
        row[1] += nbytes
        row[2] += dur
    gaps = [(a, b) for (_, a), (b, _) in zip(copies, copies[1:]) if b > a and lo <= a and b <= hi]
    big = [(a, b) for a, b in gaps if b - a >= 10.0]
    return {
        "copies_by_size": {k: {"count": int(v[0]), "gib": v[1] / (1 << 30), "busy_s": v[2] / 1e6,
                               "gb_per_s": v[1] / v[2] / 1e3 if v[2] else None} for k, v in sorted(sizes.items())},
        "copies_by_compute_beside": {k: {"count": int(v[0]), "gib": v[1] / (1 << 30), "gb_per_s": v[1] / v[2] / 1e3}
                                     for k, v in sorted(beside.items())},
        "link_gaps": {"count": len(gaps), "total_s": sum(b - a for a, b in gaps) / 1e6,
                      "over_10us": len(big), "over_10us_s": sum(b - a for a, b in big) / 1e6,
                      "over_10us_compute_s": sum(_length(compute, a, b) for a, b in big) / 1e6,
                      "over_10us_decode_s": sum(_length(decodes, a, b) for a, b in big) / 1e6},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--budget", default="12GiB", help="a size, or 'min'")
    p.add_argument("--preset", default="one_shot_fast")
    p.add_argument("--units", default="auto")
    p.add_argument("--codec", default="off", help="off, fixed (the weights coded at 12 bits, decoded on the GPU), tiered "
                                                  "(about 11 bits) or huffman (about 10.65)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/profile")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import ddo_blocks
    from benchmarks.measure import parse_size, sync, timed_calls
    from benchmarks.model import FLUX_DEV, TINY, random_model
    from ddo_blocks.tiny import flux_inputs

    dev = torch.device(args.device)
    cfg = TINY if args.tiny else FLUX_DEV
    model = random_model(cfg, dev).to("cpu")
    side, text = (8, 12) if args.tiny else (64, 512)
    x = flux_inputs(model, height=side, width=side, text_len=text, device=dev)
    weights = sum(q.numel() * q.element_size() for q in model.parameters())
    budget = "min" if args.budget == "min" else parse_size(args.budget, weights, bare_unit="B")  # vram_budget's reading
    codec = {"codec": args.codec} if args.codec != "off" else {}
    handle = ddo_blocks.offload(model, preset=args.preset, vram_budget=budget, device=dev, units=args.units, **codec)

    def call(**inputs: Any) -> Any:  # the call's host span ends after its synchronize: it covers its GPU work
        with torch.profiler.record_function("ddo_call"):
            out = model(**inputs)
            sync(dev)
            return out

    with torch.no_grad():
        for _ in range(args.warmup):
            model(**x)
        sync(dev)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            marks = timed_calls(call, x, dev, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "trace.json"
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    windows = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace["traceEvents"]
                     if e.get("ph") == "X" and e.get("name") == "ddo_call" and e.get("cat") in ("user_annotation",
                                                                                            "cpu_op"))
    # the host span of a call ends after its synchronize, so it covers the call's GPU work too
    rows = analyse(trace, windows[: args.steps])
    report = handle.report().to_dict()
    handle.remove()
    doc = {"command": "python -m benchmarks.profile " + " ".join(argv if argv is not None else sys.argv[1:]),
           "host_timed_s": marks, "calls": rows, "plan": report["plan"], "roofline": report["roofline"],
           "codec": report.get("codec")}
    (out / "profile.json").write_text(json.dumps(doc, indent=2))
    write_lanes(trace, out / "lanes.json.gz")
    for i, r in enumerate(rows):
        print(f"call {i}: span {r['span_s']:.4f} s, compute busy {r['compute_busy_s']:.4f} s, link busy "
              f"{r['link_busy_s']:.4f} s, compute idle, link busy {r['compute_idle_link_busy_s']:.4f} s, "
              f"both idle {r['idle_both_s']:.4f} s, decode busy {r['decode_busy_s']:.4f} s")
    _plot(trace, windows[: args.steps], out / "timeline.png")
    print(f"wrote {out}/profile.json, trace.json, lanes.json.gz, timeline.png")
    return 0


def write_lanes(trace: dict[str, Any], path: Path) -> None:
    """The trace's GPU lanes, small enough to keep with the results (the full trace is tens of MB):
    ``[kind, ts_us, dur_us, name, stream, bytes]`` per kernel (``k``), memcpy or memset (``mem``), and
    per profiled call (``call``)."""
    import gzip

    rows = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            a = e.get("args") or {}
            rows.append(["k" if e["cat"] == "kernel" else "mem", round(float(e["ts"]), 2), round(float(e.get("dur", 0)), 2),
                         str(e.get("name", ""))[:48], a.get("stream"), a.get("bytes")])
        elif e.get("name") == "ddo_call":
            rows.append(["call", float(e["ts"]), float(e.get("dur", 0)), "ddo_call", None, None])
    with gzip.open(path, "wt") as f:
        json.dump(rows, f)


def _plot(trace: dict[str, Any], windows: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = trace.get("traceEvents", [])
    lanes = {"compute (kernels)": _merge(_intervals(events, ("kernel",), decode=False)),
             "link (H2D copies)": _merge(_intervals(events, ("gpu_memcpy",))),
             "decode (codec)": _merge(_intervals(events, ("kernel",), decode=True))}
    if not windows:
        return
    lo, hi = windows[0][0], windows[-1][1]
    fig, ax = plt.subplots(figsize=(14, 3))
    for row, iv in enumerate(lanes.values()):
        bars = [((a - lo) / 1e3, (b - a) / 1e3) for a, b in iv if b > lo and a < hi]
        ax.broken_barh(bars, (row * 10, 8), facecolors=("tab:blue", "tab:orange", "tab:green")[row])
    ax.set_yticks([4 + 10 * i for i in range(len(lanes))], list(lanes))
    ax.set_xlabel("ms since the first profiled call")
    ax.set_title("copy and compute timelines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
