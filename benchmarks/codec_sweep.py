"""The codec's landing ring swept in one process: the Flux-dev-sized transformer built once, then
offloaded again and again (codec x budget x ring size), each row timed and checked against the
resident output, so rows that differ by one setting share the model, the machine and the link.

    python -m benchmarks.codec_sweep --budgets min,8 --codecs off,fixed,tiered --rings 8,16,32 --out "$OUT/sweep"

A row's ring size (``--rings``) is the number of landing buffers of one coded chunk each (the
product's default is :func:`ddo_blocks.streaming.coded.landing_count`, at most
``coded.LANDING_BUFFERS[1]``); ``0`` keeps the default. At ``min`` a coded row gets the
uncompressed row's budget plus its landing buffers (the same plan, as ``benchmarks.run`` does).

Per row: the step (median of ``--repeats`` after three warm-up calls: the order, the calibration,
one steady call), the link bytes per call, the roofline ``max(resident step, streamed / link)`` and
the compressed bound ``max(link bytes / link, resident step + decoded bytes / decode rate)`` (the
link: the faster of two pinned-copy probes, both recorded); on CUDA a second bound with the decode
as the model's kernels see it, ``max(link bytes / link, resident step + what the row's decodes add
to the resident forward)`` (``benchmarks.decode_in_model``; ``--no-decode-in-model`` skips it); the
setup, and whether the output is ``torch.equal`` to the resident one. Writes ``codec_sweep.json``,
``codec_sweep.md`` and ``codec_sweep.png`` (``--replot JSON`` draws the plot of an earlier run). Needs CUDA (``--device cpu`` runs the same rows on a tiny model: a dry run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def plot(doc: dict[str, Any], path: Path) -> None:
    """Each row's step as a bar (grouped by budget), the uncompressed roofline of its plan as a dashed
    line and a coded row's compressed bound as a red one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = [r for r in doc["rows"] if "error" not in r]
    colors = {"off": "tab:gray", "fixed": "tab:blue", "tiered": "tab:green", "huffman": "tab:orange"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.2))
    x, ticks, labels = 0.0, [], []
    for budget in dict.fromkeys(r["budget"] for r in rows):
        for r in (r for r in rows if r["budget"] == budget):
            lossless = r["codec"] == "lossless"  # the codec it chose, hatched
            ax.bar(x, r["step_s"], width=0.8, color=colors.get(r.get("chosen_codec") if lossless else r["codec"],
                                                               "tab:purple"), hatch="//" if lossless else None)
            if r.get("roofline_s"):
                ax.hlines(r["roofline_s"], x - 0.4, x + 0.4, colors="k", linestyles="--")
            if r.get("bound_s") and r["codec"] != "off":
                ax.hlines(r["bound_s"], x - 0.4, x + 0.4, colors="tab:red")
            ring = "" if r["codec"] == "off" or r["ring"] == "default" else f" r{r['ring']}"
            name = f"lossless:\n{r.get('chosen_codec')}" if lossless else r["codec"]
            labels.append(f"{budget}\n{name}{ring}{'+rp' if r.get('replan') else ''}")
            ticks.append(x)
            x += 1
        x += 0.6
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("step s (median)")
    by_res = doc.get("resident_step_s_by_resolution") or {}
    resident = ", ".join(f"{k}: {v:.3f} s" for k, v in by_res.items()) or f"{doc['resident_step_s']:.3f} s"
    ax.set_title(f"codec rows, {doc.get('device', '')}: resident step {resident} (hatched: codec='lossless', "
                 "coloured by what it chose)", fontsize=9)
    ax.legend(handles=[*(Patch(color=c, label=k) for k, c in colors.items()),
                       Line2D([], [], color="k", ls="--", label="roofline (uncompressed)"),
                       Line2D([], [], color="tab:red", label="compressed bound")], fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stream_ids(handle: Any) -> dict[str, Any]:
    """Torch's ids of the engine's copy and decode streams, and ``CUDA_DEVICE_MAX_CONNECTIONS``: which
    hardware queue a stream lands on follows from them, and a row's speed may too."""
    import os

    engine = handle.engine
    copy = getattr(engine, "_copy_stream", None)
    decode = getattr(getattr(engine, "store", None), "decode_stream", None)
    return {"copy": getattr(copy, "stream_id", None), "decode": getattr(decode, "stream_id", None),
            "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.codec_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="min,8", help="'min' or GiB, comma-separated (default min,8)")
    p.add_argument("--codecs", default="off,fixed,tiered")
    p.add_argument("--rings", default="0", help="landing buffers per coded row, comma-separated; 0: the default")
    p.add_argument("--rows", default=None,
                   help="explicit rows instead of the cross product: BUDGET:CODEC[:RING[:replan]], comma-separated "
                        "(e.g. 8:fixed:64,16:tiered:0:replan); replan: handle.replan() after two calls")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-decode-in-model", action="store_true",
                   help="skip the second bound: each coded row's decodes timed beside the resident forward")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--replot", type=Path, default=None,
                   help="draw codec_sweep.png from an earlier run's codec_sweep.json (next to it) and stop")
    args = p.parse_args(argv)
    if args.replot is not None:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0

    import torch

    import ddo_blocks
    from ddo_blocks.streaming import bandwidth, coded

    from .model import FLUX_DEV, TINY, make_inputs, random_model
    from .worker import measure_bandwidth

    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    t0 = time.perf_counter()
    model = random_model(FLUX_DEV if cuda else TINY, dev).to("cpu").eval()
    sync()
    build_s = time.perf_counter() - t0
    inputs: dict[int, Any] = {}

    def use(resolution: int) -> None:
        """Point ``x`` at this resolution's inputs (built once)."""
        nonlocal x
        if resolution not in inputs:
            tokens = resolution // 16 if cuda else max(2, resolution // 256)
            inputs[resolution] = make_inputs(model, height_tokens=tokens, width_tokens=tokens,
                                             text_tokens=512 if cuda else 8, device=dev, dtype=torch.bfloat16)
        x = inputs[resolution]

    x: Any = None
    use(args.resolution)

    def timed(n: int) -> tuple[list[float], Any]:
        out, times = None, []
        for _ in range(n):
            del out
            sync()
            t = time.perf_counter()
            out = model(**x)[0]
            sync()
            times.append(time.perf_counter() - t)
        return times, out

    resident: dict[int, tuple[float, Any]] = {}

    def resident_at(resolution: int) -> tuple[float, Any]:
        """The resident step and output at this resolution (measured once)."""
        if resolution not in resident:
            use(resolution)
            with torch.no_grad():
                model.to(dev)
                timed(2)
                times, out = timed(args.repeats)
                resident[resolution] = (statistics.median(times), out.clone())
                del out
                model.to("cpu")
            if cuda:
                torch.cuda.empty_cache()
        return resident[resolution]

    resident_s, ref = resident_at(args.resolution)

    def in_model(codec: str, decoded_bytes: float) -> dict[str, Any]:
        """The row's decodes timed beside the resident forward (``benchmarks.decode_in_model``)."""
        from .decode_in_model import resident_with_decodes

        model.to(dev)
        try:
            return resident_with_decodes(model, x, dev, codec, int(decoded_bytes), repeats=args.repeats)
        finally:
            model.to("cpu")
            torch.cuda.empty_cache()
    # two probes of the pinned link: 1 GiB copies from torch's pinned memory, and the planner's own
    # (the engine's page-locked memory); on some lent machines the first read 4-8 % under what the
    # uncompressed route then moved, so the roofline takes the faster
    probe = measure_bandwidth(dev, 1 << 30, [])["pinned_h2d_gb_s"] * 1e9 if cuda else None
    planner = bandwidth.link_bytes_per_s(dev) if cuda else None
    link = max(probe, planner) if cuda else None
    print(f"built in {build_s:.1f} s; resident step {resident_s:.4f} s; link {f'{link / 1e9:.2f} GB/s' if link else '-'}", flush=True)

    if args.rows:
        specs = []
        for text in args.rows.split(","):
            parts = text.split(":")
            specs.append((parts[0], parts[1], int(parts[2]) if len(parts) > 2 else 0,
                          len(parts) > 3 and parts[3] == "replan"))
    else:
        specs = [(b, c, ring, False) for b in args.budgets.split(",") for c in args.codecs.split(",")
                 for ring in ([0] if c == "off" else [int(r) for r in args.rings.split(",")])]
    default_buffers, default_ahead = coded.LANDING_BUFFERS, coded.LANDING_AHEAD
    rows: list[dict[str, Any]] = []
    for budget_spec, codec, ring, replan in specs:
        budget_text, _, res_text = budget_spec.partition("@")  # BUDGET@RESOLUTION: another input size
        resolution = int(res_text) if res_text else args.resolution
        coded.LANDING_BUFFERS, coded.LANDING_AHEAD = ((ring, ring), 1e9) if ring else (default_buffers,
                                                                                         default_ahead)
        row: dict[str, Any] = {"budget": budget_spec, "codec": codec, "ring": ring or "default",
                               "replan": replan, "resolution": resolution}
        handle = None
        try:
            resident_s, ref = resident_at(resolution)
            use(resolution)
            row["resident_step_s"] = resident_s
            if budget_text == "min":
                budget = ddo_blocks.minimum_budget(model)
                if codec != "off":
                    budget += coded.reserve_bytes(model, codec, dev)
            else:
                budget = int(float(budget_text) * (1 << 30))
            opts = {"codec": codec} if codec != "off" else {}
            t = time.perf_counter()
            handle = ddo_blocks.offload(model, preset="one_shot_fast", vram_budget=budget, device=dev,
                                        component="transformer", **opts)
            row["setup_s"] = time.perf_counter() - t
            row["streams"] = stream_ids(handle)
            with torch.no_grad():
                row["first_calls_s"] = timed(3)[0]  # lossless: its re-plan runs after the second
                if replan:
                    t = time.perf_counter()
                    row["replanned"] = handle.replan()
                    row["replan_s"] = time.perf_counter() - t
                    timed(3)
                times, out = timed(args.repeats)
            row["step_s"] = statistics.median(times)
            row["exact"] = bool(torch.equal(out, ref))
            del out
            rep = handle.report().to_dict()
            plan, cod = rep.get("plan", {}), rep.get("codec") or {}
            streamed = plan.get("streamed_bytes") or 0
            link_bytes = cod.get("link_call_bytes") or streamed
            row.update(streamed_bytes=streamed, link_bytes=link_bytes, slots=plan.get("slots"),
                       landing_buffers=cod.get("landing_buffers"), ratio=cod.get("ratio"),
                       decode_gb_s=cod.get("decode_gb_s"), decode_s=cod.get("decode_s_per_call"),
                       predicted_step_s=plan.get("predicted_step_s"),
                       measured_plan_gain=plan.get("measured_plan_gain"),
                       measured_plan_coded_fraction=plan.get("measured_plan_coded_fraction"),
                       chosen=cod.get("chosen") if cod.get("requested") else None,
                       chosen_codec=cod.get("codec") if cod.get("coded_units") else "off",
                       lossless=({k: cod.get(k) for k in ("chosen_with", "candidates_predicted_s", "replan",
                                                          "measured_choice", "predicted_gain", "measured_candidates_s",
                                                          "replan_s")}
                                 if cod.get("requested") else None),
                       setup_phases={k: v for k, v in (rep.get("setup") or {}).items() if k.endswith("_s")})
            if link:
                row["roofline_s"] = max(resident_s, streamed / link)
                row["bound_s"] = max(link_bytes / link, resident_s + (row["decode_s"] or 0.0))
                row["step_per_roofline"] = row["step_s"] / row["roofline_s"]
                row["step_per_bound"] = row["step_s"] / row["bound_s"]
            t = time.perf_counter()
            handle.remove()
            handle = None
            row["remove_s"] = time.perf_counter() - t
            if link and row["decode_s"] and not args.no_decode_in_model:
                try:
                    row["in_model"] = in_model(row["chosen_codec"], row["decode_s"] * row["decode_gb_s"] * 1e9)
                except Exception as exc:  # noqa: BLE001 - the row keeps its step
                    row["in_model"] = {"error": f"{type(exc).__name__}: {exc}"[:300], "added_s": 0.0}
                if row["in_model"]["added_s"] > 0:
                    row["bound_in_model_s"] = max(link_bytes / link, resident_s + row["in_model"]["added_s"])
                    row["step_per_bound_in_model"] = row["step_s"] / row["bound_in_model_s"]
        except Exception as exc:  # noqa: BLE001 - a row that fails is a row that says why
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        finally:
            if handle is not None:
                handle.remove()
            coded.LANDING_BUFFERS, coded.LANDING_AHEAD = default_buffers, default_ahead
            if cuda:
                torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)

    uncompressed = {r["budget"]: r.get("step_s") for r in rows if r["codec"] == "off"}
    for r in rows:
        if r.get("chosen"):
            r["codec_label"] = f"lossless -> {r['chosen_codec']}"
    lines = ["| budget | codec | ring | slots | step s | / uncompressed | / roofline | / compressed bound "
             "| / bound, decode in model | link GB/call | setup s | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("replan"):
            r["codec_label"] = f"{r['codec']}+replan ({'re-planned' if r.get('replanned') else 'plan kept'})"
        if "error" in r:
            lines.append(f"| {r['budget']} | {r['codec']} | {r['ring']} | - | error: {r['error']} | | | | | | | |")
            continue
        base = uncompressed.get(r["budget"])
        lines.append(
            f"| {r['budget']} | {r.get('codec_label', r['codec'])} | {r['ring']} ({r.get('landing_buffers') or 0}) | {r.get('slots')} "
            f"| {r['step_s']:.4f} | {r['step_s'] / base:.3f} | {r.get('step_per_roofline', float('nan')):.3f} "
            f"| {r.get('step_per_bound', float('nan')):.3f} | {r.get('step_per_bound_in_model', float('nan')):.3f} "
            f"| {r['link_bytes'] / 1e9:.2f} | {r['setup_s']:.1f} "
            f"| {r['exact']} |" if base else f"| {r['budget']} | {r['codec']} | {r['ring']} | {r['step_s']:.4f} |")
    table = "\n".join(lines)
    print(table)
    doc = {"command": "python -m benchmarks.codec_sweep " + " ".join(argv if argv is not None else sys.argv[1:]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "resident_step_s": resident[args.resolution][0],
           "resident_step_s_by_resolution": {str(k): v[0] for k, v in resident.items()},
           "link_probes_gb_s": {"torch_pinned_1GiB": probe / 1e9, "planner": planner / 1e9} if cuda else None,
           "link_gb_s": link / 1e9 if link else None, "build_s": build_s,
           "rows": rows}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "codec_sweep.json").write_text(json.dumps(doc, indent=1))
        (args.out / "codec_sweep.md").write_text(table + "\n")
        plot(doc, args.out / "codec_sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
