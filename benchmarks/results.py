"""Derived figures (rooflines, ratios, speed-ups) and the outputs: results.json, results.md and
results.png. Pure Python plus matplotlib: no torch, so merging results is instant anywhere."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

SCHEMA = "ddo_blocks.bench/1"
GIB = 1 << 30
DERIVED = (
    "label",
    "roofline_s",
    "roofline_pinned_s",
    "roofline_kind",
    "roofline_partial",
    "ratio",
    "ratio_pinned",
    "speedup_vs_diffusers_block",
    "speedup_vs_ddo_rc2",
    "host_copy_threads",
    "codec_bound_s",
    "codec_decode_s",
    "ratio_codec_bound",
)


def _codec(r: dict[str, Any]) -> str:
    return f"+{r['codec']}" if r.get("codec", "off") not in (None, "off") else ""


def _replan(r: dict[str, Any]) -> str:
    return ("+replan" if r.get("replan") else "") + ("+graph" if r.get("graph") else "")


def row_key(r: dict[str, Any]) -> str:
    sub = f"{r.get('preset') or r.get('offload_type') or '-'}{_codec(r)}{_replan(r)}"
    return f"{r.get('route')}|{sub}|{r.get('budget') or '-'}"


def label(r: dict[str, Any]) -> str:
    route = r.get("route")
    if route == "resident":
        return "all weights resident"
    if route == "ours":
        replan = ""
        if r.get("replan"):
            gain = r.get("replan_predicted_gain")
            replan = (" re-planned" if r.get("replanned") else " replan kept the plan") + (
                f" (predicted {gain:+.0%})" if gain is not None else "")
        return (f"ddo_blocks linear {r.get('preset')}" + (f" codec={r['codec']}" if _codec(r) else "") + replan
                + (" graph=True" if r.get("graph") else ""))
    if route == "diffusers":
        return f"diffusers group offload {r.get('offload_type')}" + (
            " (use_stream)" if r.get("use_stream") else ""
        )
    if route == "ddo":
        return f"DDO 0.1.0rc2 {r.get('preset')}"
    return str(route)


def _ok(r: dict[str, Any]) -> bool:
    return r.get("status") == "ok" and isinstance(r.get("step_s"), (int, float))


def _host_copy_at(host: dict[str, float], threads: int) -> tuple[int, float] | None:
    if not host:
        return None
    counts = sorted(int(k) for k in host)
    below = [c for c in counts if c <= threads]
    n = below[-1] if below else counts[0]
    return n, float(host[str(n)])


def derive(doc: dict[str, Any]) -> dict[str, Any]:
    """Fills every row's roofline, ratios and speed-ups, and the document's comparisons."""
    rows = doc.get("rows", [])
    bw = doc.get("bandwidth") or {}
    link = bw.get("pinned_h2d_gb_s")
    host = bw.get("host_copy_gb_s") or {}
    cpu_count = (doc.get("machine") or {}).get("cpu_count") or 8
    resident = [r for r in rows if r.get("route") == "resident" and _ok(r)]
    compute_s = resident[0]["step_s"] if resident else None
    doc["derived"] = {
        "compute_s": compute_s,
        "compute_source": "the all-resident row's median step"
        if compute_s is not None
        else "missing (no resident row)",
        "link_gb_s": link,
        "host_copy_gb_s": host,
    }
    for r in rows:
        for k in DERIVED:
            r[k] = None
        r["label"] = label(r)
        if not _ok(r):
            continue
        if r.get("run_bandwidth"):  # a merged row: the bandwidth measured in its own run
            run_link = r["run_bandwidth"].get("pinned_h2d_gb_s")
            link_bps = run_link * 1e9 if run_link else None
            host = r["run_bandwidth"].get("host_copy_gb_s") or {}
        else:
            link_bps, host = (link * 1e9 if link else None), doc["derived"]["host_copy_gb_s"]
        streamed = r.get("streamed_bytes")
        transfer = streamed / link_bps if streamed is not None and link_bps else None
        terms = [x for x in (compute_s, transfer) if x is not None]
        r["roofline_pinned_s"] = max(terms) if terms else None
        kind = "max(compute, streamed / pinned link)"
        roof = r["roofline_pinned_s"]
        if r.get("preset") == "low_ram_safe" and streamed is not None and link_bps:
            threads = r.get("staging_threads") or min(8, cpu_count)
            hc = _host_copy_at(host, threads)
            if hc is not None:
                n, gbs = hc
                eff = min(link_bps, gbs * 1e9)
                roof = max([x for x in (compute_s, streamed / eff) if x is not None])
                kind = f"max(compute, streamed / min(pinned link, host copy with {n} threads))"
                r["host_copy_threads"] = n
        if compute_s is None or transfer is None:
            r["roofline_partial"] = True
            kind += " (partial: " + ("no resident row" if compute_s is None else "no link bandwidth") + ")"
        r["roofline_s"] = roof
        r["roofline_kind"] = kind
        r["ratio"] = r["step_s"] / roof if roof else None
        r["ratio_pinned"] = r["step_s"] / r["roofline_pinned_s"] if r["roofline_pinned_s"] else None
        codec = ((r.get("report") or {}).get("codec") or {}) if _codec(r) else {}
        if codec.get("link_call_bytes") is not None and link_bps and compute_s is not None:
            # the compressed bound: the coded bytes over the link, or the compute plus the decode
            # (it shares the SMs with the model's kernels), at the decode rate measured at attach
            rate = codec.get("decode_gb_s")
            decode = (codec.get("coded_bytes") or 0) / (rate * 1e9) if rate else 0.0
            r["codec_bound_s"] = max(codec["link_call_bytes"] / link_bps, compute_s + decode)
            r["codec_decode_s"] = decode
            r["ratio_codec_bound"] = r["step_s"] / r["codec_bound_s"]
    _speedups(doc)
    return doc


def _peak(r: dict[str, Any]) -> int | None:
    return r.get("gpu_peak_allocated")


def _fits(ours: dict[str, Any], peer: dict[str, Any]) -> bool:
    """Ours uses equal or lower peak GPU memory than the peer (no GPU figures, e.g. on the CPU: yes)."""
    a, b = _peak(ours), _peak(peer)
    if a is None or b is None:
        return True
    return a <= b


def _speedups(doc: dict[str, Any]) -> None:
    rows = [r for r in doc.get("rows", []) if _ok(r)]
    ours = [r for r in rows if r.get("route") == "ours"]
    block = [r for r in rows if r.get("route") == "diffusers" and r.get("offload_type") == "block_level"]
    ddo = [r for r in rows if r.get("route") == "ddo"]
    for o in ours:
        for key, peers in (("speedup_vs_diffusers_block", block), ("speedup_vs_ddo_rc2", ddo)):
            fitting = [p for p in peers if _fits(o, p)]
            # the fastest peer row that uses at least as much GPU memory as ours: the conservative figure
            o[key] = min(p["step_s"] for p in fitting) / o["step_s"] if fitting else None
    comps = []
    for p in [r for r in rows if r.get("route") in ("diffusers", "ddo")]:
        entry: dict[str, Any] = {
            "peer": p["label"] + (f" @ {p['budget']}" if p.get("budget") else ""),
            "peer_step_s": p["step_s"],
            "peer_gpu_peak_allocated": _peak(p),
            "peer_host_peak_rss": p.get("host_peak_rss"),
        }
        for tag, pool in (
            ("best", ours),
            ("same_preset", [o for o in ours if o.get("preset") == p.get("preset")]),
        ):
            if tag == "same_preset" and not p.get("preset"):
                continue
            fitting = [o for o in pool if _fits(o, p)]
            if fitting:
                best = min(fitting, key=lambda o: o["step_s"])
                within = True
            elif pool:
                best = min(pool, key=lambda o: _peak(o) or 0)
                within = False
            else:
                continue
            entry[tag] = {
                "ours": f"{best['label']} @ {best.get('budget')}",
                "ours_step_s": best["step_s"],
                "ours_gpu_peak_allocated": _peak(best),
                "ours_host_peak_rss": best.get("host_peak_rss"),
                "within_peer_gpu_peak": within,
                "speedup": p["step_s"] / best["step_s"],
            }
        comps.append(entry)
    doc["comparisons"] = comps


# -------------------------------------------------------------------------------------------------
# output
# -------------------------------------------------------------------------------------------------
def _g(n: Any, digits: int = 2) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    return f"{n / GIB:.{digits}f}"


def _s(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}"


def _x(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}x"


def markdown(doc: dict[str, Any]) -> str:
    m = doc.get("machine") or {}
    c = doc.get("config") or {}
    d = doc.get("derived") or {}
    bw = doc.get("bandwidth") or {}
    model = c.get("model") or {}
    lines = [
        f"# ddo-blocks benchmark: {model.get('description', 'model')} on {m.get('gpu_name') or 'CPU'}",
        "",
        f"- date: {doc.get('created')}",
        f"- command: `{doc.get('command')}`",
        f"- machine: {m.get('gpu_name') or 'no GPU'}"
        + (
            f" ({_g(m.get('gpu_memory_bytes'), 0)} GiB, driver {m.get('driver')}"
            + (f", {m['pcie']}" if m.get("pcie") else "")
            + ")"
            if m.get("gpu_name")
            else ""
        )
        + f", {m.get('cpu_count')} CPUs, {_g(m.get('ram_bytes'), 0)} GiB RAM, {m.get('platform')}",
        (
            f"- software: Python {m.get('python')}, torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), "
            f"diffusers {m.get('diffusers')}, ddo_blocks {m.get('ddo_blocks')}, "
            f"diffusers-dynamic-offloader {m.get('ddo_rc2') or 'not installed'}"
        ),
        (
            f"- model: {model.get('description')}, {_g(model.get('weight_bytes'))} GiB of {c.get('dtype')} weights; "
            f"one forward = {c.get('image_tokens')} image + {c.get('text_tokens')} text tokens "
            f"({c.get('resolution')}x{c.get('resolution')}); step = median of {c.get('repeats')} timed calls after "
            f"{c.get('warmup')} warm-up call(s); isolation: {c.get('isolation_used') or c.get('isolation')} (one process per row)"
        ),
        "",
        "## Link and host copy bandwidth (decimal GB/s)",
        "",
        "| pinned host->device | pageable host->device | pageable->pinned host copy (threads: GB/s) | copy size |",
        "|---|---|---|---|",
        f"| {_s(bw.get('pinned_h2d_gb_s'), 1)} | {_s(bw.get('pageable_h2d_gb_s'), 1)} | "
        + ", ".join(
            f"{k}: {v:.1f}"
            for k, v in sorted((bw.get("host_copy_gb_s") or {}).items(), key=lambda kv: int(kv[0]))
        )
        + f" | {_g(bw.get('bytes'))} GiB |",
        "",
        f"Compute bound (all weights resident): {_s(d.get('compute_s'))} s ({d.get('compute_source')}).",
        "",
        "## Results",
        "",
        (
            "| route | preset | budget | step s | roofline s | step / roofline | peak GPU alloc GiB | peak GPU reserved GiB "
            "| peak host RSS GiB | pinned GiB | setup s | first call s | predicted s | calibrated s | streamed GiB "
            "| speed-up vs diffusers block | speed-up vs DDO rc2 | notes |"
        ),
        "|" + "---|" * 18,
    ]
    notes_all = list(doc.get("notes", []))
    for r in doc.get("rows", []):
        notes = []
        if r.get("status") != "ok":
            notes.append(f"**{r.get('status')}**: {r.get('error') or r.get('note') or ''}".strip())
        elif r.get("note"):
            notes.append(str(r["note"]))
        if (r.get("streamed_bytes_source") or "").startswith("estimate"):
            notes.append("streamed = weights - GPU alloc after attach")
        if (r.get("roofline_kind") or "").startswith("max(compute, streamed / min"):
            pinned = f"; {r['ratio_pinned']:.2f}x of the pinned-link roofline" if r.get("ratio_pinned") else ""
            notes.append(f"low_ram_safe bound (host copy x{r.get('host_copy_threads')}){pinned}")
        if r.get("roofline_partial"):
            notes.append("partial roofline")
        if r.get("warm_setup_s") is not None:
            notes.append(
                f"warm re-offload {r['warm_setup_s']:.2f} s (reused: {r.get('warm_reused')}), "
                f"then {_s(r.get('warm_step_s'))} s/step"
            )
        if r.get("ddo_route") and r.get("ddo_route") != "dynamic_offload":
            notes.append(f"DDO route {r['ddo_route']}")
        pin = r.get("pinned_bytes")
        lines.append(
            f"| {r.get('label') or label(r)} | {r.get('preset') or r.get('offload_type') or '-'} | {r.get('budget') or '-'} "
            f"| {_s(r.get('step_s'))} | {_s(r.get('roofline_s'))} | {_x(r.get('ratio'))} "
            f"| {_g(r.get('gpu_peak_allocated'))} | {_g(r.get('gpu_peak_reserved'))} | {_g(r.get('host_peak_rss'))} "
            f"| {_g(pin) if pin is not None else '-'} | {_s(r.get('setup_s'), 2)} | {_s(r.get('first_call_s'))} "
            f"| {_s(r.get('predicted_step_s'))} "
            f"| {_s(((r.get('report') or {}).get('runtime') or {}).get('calibrated_predicted_step_s'))} "
            f"| {_g(r.get('streamed_bytes'))} "
            f"| {_x(r.get('speedup_vs_diffusers_block'))} | {_x(r.get('speedup_vs_ddo_rc2'))} "
            f"| {'; '.join(notes).replace('|', '/')} |"
        )
    coded = [r for r in doc.get("rows", []) if _codec(r) and _ok(r)]
    if coded:
        lines += [
            "",
            "## Compressed transfer (codec)",
            "",
            (
                "Rows with a codec against two bounds: the uncompressed roofline above (`max(compute, streamed / "
                "link)`) and the compressed bound `max(link bytes / link, compute + decoded bytes / decode rate)`, "
                "with the decode rate the row measured at attach (the decode shares the SMs with the model)."
            ),
            "",
            (
                "| row | budget | step s | uncompressed roofline s | step / roofline | streamed GiB | link GiB per call "
                "| host / weights | decode GB/s | compressed bound s | step / compressed bound |"
            ),
            "|" + "---|" * 11,
        ]
        for r in coded:
            c = (r.get("report") or {}).get("codec") or {}
            lines.append(
                f"| {r.get('label') or label(r)} | {r.get('budget') or '-'} | {_s(r.get('step_s'))} "
                f"| {_s(r.get('roofline_s'))} | {_x(r.get('ratio'))} | {_g(r.get('streamed_bytes'))} "
                f"| {_g(c.get('link_call_bytes'))} | {_s(c.get('ratio'))} | {_s(c.get('decode_gb_s'), 0)} "
                f"| {_s(r.get('codec_bound_s'))} | {_x(r.get('ratio_codec_bound'))} |"
            )
    comps = doc.get("comparisons") or []
    if comps:
        lines += [
            "",
            "## Against the peers at equal or lower peak GPU memory",
            "",
            (
                "For each peer row: our fastest row whose peak GPU allocated is not above the peer's "
                "(or, marked *over*, our row with the smallest peak when none fits), and the speed-up "
                "(peer step / our step)."
            ),
            "",
            (
                "| peer | peer step s | peer peak GPU GiB | peer host RSS GiB | our row | our step s | our peak GPU GiB "
                "| our host RSS GiB | speed-up | same preset: our row, speed-up |"
            ),
            "|" + "---|" * 10,
        ]
        for e in comps:
            b = e.get("best") or {}
            sp = e.get("same_preset")
            same = (
                "-"
                if not sp
                else (
                    f"{sp['ours']}, {_x(sp['speedup'])}" + ("" if sp["within_peer_gpu_peak"] else " *over*")
                )
            )
            lines.append(
                f"| {e['peer']} | {_s(e['peer_step_s'])} | {_g(e.get('peer_gpu_peak_allocated'))} "
                f"| {_g(e.get('peer_host_peak_rss'))} | {b.get('ours', '-')}"
                + ("" if b.get("within_peer_gpu_peak", True) else " *over*")
                + f" | {_s(b.get('ours_step_s'))} | {_g(b.get('ours_gpu_peak_allocated'))} "
                f"| {_g(b.get('ours_host_peak_rss'))} | {_x(b.get('speedup'))} | {same} |"
            )
    lines += [
        "",
        "## Columns",
        "",
        "- **step s**: median wall time of one forward (synchronised before and after) over the timed calls.",
        (
            "- **roofline s**: `max(compute_s, streamed_bytes / pinned_h2d_bandwidth)`; for `low_ram_safe` rows "
            "`max(compute_s, streamed_bytes / min(pinned_h2d_bandwidth, host_copy_bandwidth at the staging threads))`. "
            "compute_s is the resident row's step; streamed bytes are the row's own (ours: the report's "
            "`plan.streamed_bytes`; peers: weight bytes minus the GPU memory allocated right after attaching, "
            "i.e. what they keep resident). `ratio_pinned` in the JSON is every row against the pinned roofline. "
            "In a merged result each row uses the bandwidths measured in its own run (`run_bandwidth`)."
        ),
        (
            "- **peak GPU alloc / reserved**: `torch.cuda.max_memory_allocated/reserved()`, reset after the warm-up, "
            "over the timed calls (the setup phase's peak is `gpu_setup_peak_allocated` in the JSON). "
            "Low VRAM is simulated by the budget on a large card."
        ),
        (
            "- **peak host RSS**: the row's process, max of a 10 ms psutil sampler and `ru_maxrss`; it includes "
            "the loaded model (about the weight size) since every process starts with it in pageable memory."
        ),
        (
            "- **pinned**: ours: page-locked slab bytes from the report (`memory.pinned_bytes`); peers: the torch "
            "pinned allocator's peak (power-of-two rounded)."
        ),
        (
            "- **setup s**: wall time of the attach call (offload / enable_group_offload / enable_offload / .to()), "
            "pinning included. **first call s**: the first forward (order tracing, cold slots), "
            + ("after a process warm-up (one forward of a 1 + 1 block model of the same width and shapes, "
               "`process_warmup_s` in the JSON) so CUDA and kernel loading are not counted. "
               if any(r.get("process_warmup_s") is not None for r in doc.get("rows", []))
               else "CUDA and kernel loading included (no process warm-up in this run). ")
            + "**predicted s**: our planner's `plan.predicted_step_s` (before any call; "
            "compute from a prior). **calibrated s**: the same simulator with the compute measured on the second call "
            "(`runtime.calibrated_predicted_step_s`)."
        ),
        (
            "- **speed-up vs ...**: the fastest peer row (diffusers block_level; any DDO rc2 row) whose peak GPU "
            "allocated is at least ours, divided by our step; `-` when no peer row uses that much memory."
        ),
    ]
    if notes_all:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes_all]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc.get("rows", []) if _ok(r)]
    d = doc.get("derived") or {}
    model = (doc.get("config") or {}).get("model") or {}
    w = model.get("weight_bytes") or 0
    gpu = any(r.get("gpu_peak_allocated") is not None for r in rows)
    unit, scale = (
        ("GiB", GIB) if w >= GIB // 2 or not w else (("MiB", 1 << 20) if w >= 1 << 20 else ("KiB", 1024))
    )

    def xval(r: dict[str, Any]) -> float:
        if r.get("gpu_peak_allocated") is not None:
            return r["gpu_peak_allocated"] / scale
        if r.get("budget_bytes"):
            return r["budget_bytes"] / scale
        return w / scale

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(r["label"], []).append(r)
    markers = "os^vD<>pP*Xh"
    for i, (name, rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=xval)
        xs = [xval(r) for r in rs]
        kw = {"marker": markers[i % len(markers)], "label": name, "linestyle": "-" if len(rs) > 1 else "none"}
        ax1.plot(xs, [r["step_s"] for r in rs], **kw)
        ax2.plot(xs, [(r.get("host_peak_rss") or 0) / GIB for r in rs], **kw)
        for r, x in zip(rs, xs):
            if r.get("budget"):
                ax1.annotate(
                    str(r["budget"]),
                    (x, r["step_s"]),
                    fontsize=6,
                    alpha=0.6,
                    textcoords="offset points",
                    xytext=(3, 3),
                )
    roofs = [(xval(r), r["roofline_s"]) for r in rows if r.get("roofline_s")]
    if roofs:
        ax1.scatter(
            [x for x, _ in roofs],
            [y for _, y in roofs],
            marker="_",
            s=120,
            color="black",
            alpha=0.6,
            label="each row's roofline (its streamed bytes)",
        )
    link = d.get("link_gb_s")
    compute = d.get("compute_s")
    if link and w:
        xmax = max([xval(r) for r in rows] + [w / scale]) * 1.05
        xs = [xmax * i / 200 for i in range(201)]
        ys = [max(compute or 0, max(0.0, w - x * scale) / (link * 1e9)) for x in xs]
        ax1.plot(
            xs,
            ys,
            "k--",
            linewidth=1.2,
            label=f"ideal roofline: max(compute, (weights - VRAM) / {link:.1f} GB/s)",
        )
    if compute:
        ax1.axhline(compute, color="grey", linestyle=":", linewidth=1, label=f"compute bound {compute:.3f} s")
    xl = f"peak GPU allocated ({unit})" if gpu else f"weight budget ({unit}; no GPU)"
    ax1.set_xlabel(xl)
    ax1.set_ylabel("one forward (s), median")
    ax1.set_yscale("log")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.set_title("step time against VRAM")
    ax1.legend(fontsize=7)
    if w:
        ax2.axhline(w / GIB, color="grey", linestyle=":", linewidth=1, label=f"weights {w / GIB:.2f} GiB")
    ax2.set_xlabel(xl)
    ax2.set_ylabel("peak host RSS (GiB)")
    ax2.grid(True, alpha=0.3)
    ax2.set_title("host RAM")
    ax2.legend(fontsize=7)
    m = doc.get("machine") or {}
    fig.suptitle(
        f"{model.get('description', '')} on {m.get('gpu_name') or 'CPU'} ({doc.get('created', '')[:10]})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write(doc: dict[str, Any], out: Path, *, with_plot: bool = True) -> dict[str, Path]:
    """Derives and writes results.json, results.md and (with_plot) results.png into ``out``."""
    derive(doc)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, paths["json"])
    paths["md"].write_text(markdown(doc))
    if with_plot:
        plot(doc, paths["png"])
    return paths


def merge(docs: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """One document from several runs: rows keyed by (route, preset, budget), later runs winning;
    each row keeps the bandwidth of its own run (its roofline uses it); the document's bandwidth and
    machine come from the latest run that has them."""
    if not docs:
        raise ValueError("nothing to merge")
    base = json.loads(json.dumps(docs[0]))
    models = {json.dumps((d.get("config") or {}).get("model", {}).get("cfg"), sort_keys=True) for d in docs}
    notes = list(base.get("notes", []))
    if len(models) > 1:
        notes.append("WARNING: the merged runs used different model configs")
    gpus = {(d.get("machine") or {}).get("gpu_name") for d in docs}
    if len(gpus) > 1:
        notes.append(f"WARNING: the merged runs come from different GPUs: {sorted(map(str, gpus))}")
    rows: dict[str, dict[str, Any]] = {}
    for d, src in zip(docs, sources):
        for r in d.get("rows", []):
            key = row_key(r)
            if key in rows and _ok(rows[key]) and not _ok(r):
                continue  # keep a measured row over a later skipped/failed one
            r = dict(r)
            r["source_run"] = src
            r["run_bandwidth"] = d.get("bandwidth")  # its roofline uses the link measured in its run
            rows[key] = r
        if d.get("bandwidth"):
            base["bandwidth"] = d["bandwidth"]
        if d.get("machine"):
            base["machine"] = d["machine"]
        notes += [n for n in d.get("notes", []) if n not in notes]
    base["rows"] = list(rows.values())
    base["notes"] = notes
    base["merged_from"] = [
        {"dir": s, "command": d.get("command"), "created": d.get("created")} for d, s in zip(docs, sources)
    ]
    base["command"] = " ; ".join(str(d.get("command")) for d in docs)
    return base
