"""``vram_budget="auto"`` on a model that does not fit: no out-of-memory, and the step against the
roofline of the budget it chose.

    python -m benchmarks.auto_budget --card 16 --resolutions 1024,2048 --out "$OUT/auto"

Builds the Flux-dev-sized transformer (random bf16 weights, built on the device, moved to the host),
measures its resident step at each resolution on the whole card, then fills the card so that only
``--card`` GiB stay free (a smaller card, simulated) and offloads with ``vram_budget="auto"``: the
first call runs at half the free memory and measures its activations, the second each unit's compute,
after it the component is re-planned once. Per resolution: the first and re-planned budgets, the measured activations, the
steady step, its roofline ``max(resident step, streamed / link)`` at the chosen plan, peak GPU memory
and whether the output equals the resident one (compared as a hash of its bytes). A first call that
runs out of device memory beside the first budget (the offload then attaches its smallest plan and
says to call again) is called again; the row says so.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import platform
import statistics
import subprocess
import sys
from typing import Any

from .measure import GIB, call_again, sync, time_forward, write_rows


def _digest(t: Any) -> str:
    """A hash of a tensor's bytes (exactness across the resident and offloaded runs)."""
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _plan_figures(handle: Any, rep: dict[str, Any]) -> dict[str, Any]:
    """The plan the offload chose and what its calibration call measured, unit by unit (the
    planner's inputs, to study its choice offline)."""
    plan, runtime = rep["plan"], rep["runtime"]
    engine = handle.engine
    cal = engine.scheduler.calibration
    measured = cal.resolve(len(engine.units)) if cal is not None and cal.end is not None else None
    return {
        "granularity": plan.get("unit_granularity"), "slots": plan.get("slots"), "slot_bytes": plan.get("slot_bytes"),
        "resident_units": plan.get("resident_units"), "streamed_units": plan.get("streamed_units"),
        "predicted_step_s": plan.get("predicted_step_s"),
        "calibrated_predicted_step_s": runtime.get("calibrated_predicted_step_s"),
        "measured_plan_step_s": plan.get("measured_plan_step_s"), "measured_plan_gain": plan.get("measured_plan_gain"),
        "base_bytes": engine.unit_plan.base_bytes, "unit_bytes": list(engine.unit_bytes),
        "resident": [bool(r) for r in engine.plan.resident],
        "unit_compute_s": measured["unit_compute_s"] if measured else None,
        "rest_s": measured["rest_s"] if measured else None,
    }


def _replanned(handle: Any, model: Any, x: dict[str, Any], dev: Any, args: Any, warmup: int, resident_s: float,
               link: float, digest: str) -> dict[str, Any]:
    """``handle.replan()`` and the calls timed again at the plan it attached."""
    import time

    from ddo_blocks import OffloadStateError

    t0 = time.perf_counter()
    try:
        changed = handle.replan()
    except OffloadStateError as exc:  # nothing streamed: nothing to re-plan
        return {"changed": False, "reason": str(exc)}
    out: dict[str, Any] = {"changed": changed, "replan_s": time.perf_counter() - t0}
    if changed:
        t = time_forward(model, x, dev, repeats=args.repeats, warmup=warmup, keep_output=True)
        rep = handle.report().to_dict()
        roof = max(resident_s, rep["plan"]["streamed_bytes"] / link)
        out.update(step_s=t.step_s, roofline_s=roof, ratio=t.step_s / roof, exact=_digest(t.output[0]) == digest,
                   streamed_bytes=rep["plan"]["streamed_bytes"], plan=_plan_figures(handle, rep))
        del t
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.auto_budget", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny model (a smoke run; on the CPU nothing is measured)")
    p.add_argument("--card", type=float, default=16, help="GiB left free on the device (default 16)")
    p.add_argument("--resolutions", default="1024,2048", help="image sides in pixels (default 1024,2048)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--graph", action="store_true",
                   help="graph=True: the steady calls replayed as CUDA graphs (more warm-up calls: the captures)")
    p.add_argument("--replan", action="store_true",
                   help="after the timed calls, OffloadHandle.replan() (the measured compute) and the calls timed again")
    p.add_argument("--out", default="benchmarks/results/auto-budget")
    args = p.parse_args(argv)

    import torch

    import ddo_blocks
    from benchmarks.model import FLUX_DEV, TINY, make_inputs, random_model
    from ddo_blocks.streaming.graph import WARMUP_CALLS

    dev = torch.device(args.device)
    cfg = TINY if args.tiny else FLUX_DEV
    model = random_model(cfg, dev)
    weights = sum(q.numel() * q.element_size() for q in model.parameters())
    sides = [int(s) for s in args.resolutions.split(",")]
    inputs = {}
    resident = {}
    for side in sides:  # the resident reference on the whole card
        tokens = max(1, side // 16)
        x = make_inputs(model, height_tokens=tokens, width_tokens=tokens, text_tokens=512 if not args.tiny else 16,
                        device=dev, dtype=torch.bfloat16)
        x = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
        t = time_forward(model, x, dev, repeats=args.repeats, warmup=1, keep_output=True)
        inputs[side] = x
        resident[side] = (t.step_s, _digest(t.output[0]))
        del t
    model.to("cpu")
    sync(dev)
    blocker = None
    blocked = 0
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(dev)
        keep = int(args.card * GIB)
        if free > keep:
            blocked = free - keep
            blocker = torch.empty(blocked, dtype=torch.uint8, device=dev)  # the rest of the card, taken
    rows = []
    for side in sides:
        x = inputs[side]
        row: dict[str, Any] = {"resolution": side, "resident_step_s": resident[side][0]}
        try:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            handle = ddo_blocks.offload(model, vram_budget="auto", device=dev, component="transformer",
                                        **({"graph": True} if args.graph else {}))
            # the first call measures the activations, the second each unit's compute, then the re-plan
            # starts a new engine; with graphs its first calls are eager, then one capture per slot state
            # (at most 4)
            warmup = 3 + (WARMUP_CALLS + 4 if args.graph else 0)
            try:
                t = time_forward(model, x, dev, repeats=args.repeats, warmup=warmup, keep_output=True)
            except torch.OutOfMemoryError as exc:
                why = call_again(exc)  # the first call ran out of memory: attached at the smallest plan
                if why is None:
                    raise
                row["out_of_memory_before"] = why
                del exc
                torch.cuda.empty_cache()
                t = time_forward(model, x, dev, repeats=args.repeats, warmup=warmup, keep_output=True)
            rep = handle.report().to_dict()
            auto, plan = rep["auto_budget"], rep["plan"]
            link = rep["roofline"]["link_gb_s"] * 1e9
            roof = max(resident[side][0], plan["streamed_bytes"] / link)
            row.update(status="ok", step_s=t.step_s, first_call_s=t.first_call_s, roofline_s=roof,
                       ratio=t.step_s / roof, exact=_digest(t.output[0]) == resident[side][1],
                       free_bytes=auto["free_bytes"], first_budget_bytes=auto["first_budget_bytes"],
                       activation_bytes=auto["activation_bytes"], budget_bytes=plan["vram_budget"],
                       reason=auto["reason"], streamed_bytes=plan["streamed_bytes"], gpu_bytes=plan["gpu_bytes"],
                       graph=rep.get("graph"), host_call_s=statistics.median(t.host_times) if t.host_times else None,
                       # the filler tensor is allocated through PyTorch too: not counted
                       gpu_peak_allocated=torch.cuda.max_memory_allocated(dev) - blocked if dev.type == "cuda" else None)
            row["plan"] = _plan_figures(handle, rep)
            del t
            if args.replan:
                row["replan"] = _replanned(handle, model, x, dev, args, warmup, resident_s=resident[side][0], link=link,
                                           digest=resident[side][1])
            handle.remove()
        except torch.OutOfMemoryError as exc:
            row.update(status="out of memory", error=str(exc).splitlines()[0], exact=False)
            handle = ddo_blocks.get_handle(model)
            if handle is not None:  # the next resolution offloads the model again
                handle.remove()
        rows.append(row)
    del blocker
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git where an archive of the tree runs: the caller records the commit
        commit = ""
    doc = {"created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "command": "python -m benchmarks.auto_budget " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": commit or None, "machine": platform.node(), "device": str(dev),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
           "weights_bytes": weights, "card_gib": args.card, "rows": rows}

    def g_(n: Any) -> str:
        return "-" if n is None else f"{n / GIB:.2f}"

    lines = [f"# vram_budget='auto'{' with graph=True' if args.graph else ''} with {args.card:g} GiB free "
             f"({doc['gpu'] or dev})", "",
             f"- {doc['created']}, `{doc['command']}`, commit {doc['commit']}", "",
             "| resolution | free GiB | first budget GiB | activations GiB | chosen budget GiB | streamed GiB "
             "| peak GPU GiB | step s | roofline s | step / roofline | exact | status |",
             "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['resolution']} | {g_(r.get('free_bytes'))} | {g_(r.get('first_budget_bytes'))} "
                     f"| {g_(r.get('activation_bytes'))} | {g_(r.get('budget_bytes'))} | {g_(r.get('streamed_bytes'))} "
                     f"| {g_(r.get('gpu_peak_allocated'))} | {r.get('step_s', 0):.3f} | {r.get('roofline_s', 0):.3f} "
                     f"| {r.get('ratio', 0):.2f}x | {'yes' if r.get('exact') else 'no'} | {r['status']}"
                     f"{' (the first call ran out of memory and was called again)' if r.get('out_of_memory_before') else ''} |")
    return write_rows(args.out, "auto_budget", doc, "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
