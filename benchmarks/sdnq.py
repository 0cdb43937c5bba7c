"""The SDNQ packed route against the same transformer streamed in bf16, in one process.

A Flux-dev-sized transformer with random weights (seeded, built on the device in bf16) is streamed
as is on the linear route, then quantized with SDNQ (int8, uint4; ``sdnq`` must be installed: it is
GPL-3.0 and only this script and the tests use it) and streamed packed on the sdnq route, at each
budget. Every format's roofline is ``max(its resident compute, streamed bytes / link)``, its
resident compute measured in the same process; each offloaded step is compared with that format's
resident output (``torch.equal``). Rows share one process (not isolated as in benchmarks.run); a
row's host memory is the process's RSS once attached less its RSS with that model resident on the
GPU (both after ``malloc_trim``), against the host slabs and the packed weights. ``--ddo`` adds the
original DDO (``enable_offload(..., route="dynamic_offload")``, which takes SDNQ layers to its
``sdnq_runtime``) at the first
budget, last for each format (it keeps the model). SDNQ compiles its dequantizer per tensor shape
(``torch.compile``, ``dynamic=False``): every row starts from an empty compile cache
(``torch._dynamo.reset()``) and compiles in its two warm-up calls, so no row inherits another's
graphs; the last row of each format is the resident run again, to show any drift within the process.

    python -m benchmarks.sdnq --budgets 2,4,8 --formats bf16,int8,uint4 --out DIR
    python -m benchmarks.sdnq --tiny --device cpu --out DIR      # the tests
"""

from __future__ import annotations

import argparse
import copy
import warnings
from datetime import UTC, datetime
from typing import Any

import torch

from benchmarks.measure import host_rss, parse_size, time_forward, write_rows


def _quantize(model: torch.nn.Module, fmt: str, device: torch.device, tiny: bool) -> torch.nn.Module:
    import sdnq

    kw = {"minimum_allowed_numel": 0, "minimum_allowed_channel_size": 0} if tiny else {}
    if device.type == "cuda":
        kw.update(quantization_device=device, return_device=torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sdnq.sdnq_post_load_quant(model, weights_dtype=fmt, torch_dtype=torch.bfloat16, **kw).eval()


def _build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    from benchmarks.model import FLUX_DEV
    from ddo_blocks.tiny import TINY_FLUX_TRANSFORMER

    cfg = TINY_FLUX_TRANSFORMER if args.tiny else {**FLUX_DEV, "axes_dims_rope": tuple(FLUX_DEV["axes_dims_rope"])}
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**cfg)
    finally:
        torch.set_default_dtype(default)
    return model.to("cpu").eval().requires_grad_(False)


def _inputs(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from benchmarks.model import make_inputs

    side, text = (4, 8) if args.tiny else (64, 512)
    x = make_inputs(model, height_tokens=side, width_tokens=side, text_tokens=text, device=device,
                    dtype=torch.bfloat16)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def _weights(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _resident_rss(model: torch.nn.Module, device: torch.device) -> int:
    """The RSS with ``model`` resident on ``device`` (its host copies freed), then ``model`` back on
    the CPU: the baseline a row's host memory is measured from."""
    model.to(device)
    rss = host_rss()
    model.to("cpu")
    return rss


def _peak_reset(device: torch.device):
    def reset() -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    return reset


def _timed(model: Any, x: dict[str, Any], args: argparse.Namespace, device: torch.device, **kw: Any) -> Any:
    """The row's timing, from an empty compile cache (see the module docs)."""
    torch._dynamo.reset()
    return time_forward(lambda **k: model(**k)[0], x, device, repeats=args.repeats, warmup=2, **kw)


def _row(fmt: str, route: str, budget: int | None, timing: Any, roof: float, ref: torch.Tensor,
         model: torch.nn.Module, device: torch.device, rss0: int | None, **extra: Any) -> dict[str, Any]:
    return {"format": fmt, "route": route, "budget": budget, "step_s": timing.step_s, "host_s": timing.host_s,
            "first_call_s": timing.first_call_s, "roofline_s": roof, "ratio": timing.step_s / roof,
            "peak_gpu_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "host_rss_bytes": host_rss() - rss0 if rss0 is not None else None, "weight_bytes": _weights(model),
            "exact": bool(torch.equal(timing.output, ref)), **extra}


def _rows_for(model: torch.nn.Module, fmt: str, args: argparse.Namespace, device: torch.device,
              link: float) -> list[dict[str, Any]]:
    import ddo_blocks

    x = _inputs(model, args, device)
    model.to(device)
    resident = _timed(model, x, args, device, keep_output=True)
    ref = resident.output
    model.to("cpu")
    rows = [_row(fmt, "resident", None, resident, resident.step_s, ref, model, device, None)]
    route = "linear" if fmt == "bf16" else "sdnq"
    for budget in args.budgets:
        rss0 = _resident_rss(model, device)
        handle = ddo_blocks.offload(model, route=route, vram_budget=budget, device=device, component="transformer",
                                    units=args.units)
        timing = _timed(model, x, args, device, after_warmup=_peak_reset(device), keep_output=True)
        rep = handle.report()
        plan, runtime = rep["plan"], rep["runtime"]
        streamed = plan["streamed_bytes"]
        rows.append(_row(
            fmt, handle.route, budget, timing, max(resident.step_s, streamed / link), ref, model, device, rss0,
            streamed_bytes=streamed, gpu_bytes=plan["gpu_bytes"], host_slab_bytes=plan["host_slab_bytes"],
            pinned_bytes=rep["memory"]["pinned_bytes"], report_efficiency=rep["roofline"]["efficiency"],
            slots=plan["slots"], slot_bytes=plan["slot_bytes"], units=plan["units"],
            resident_units=plan["resident_units"], granularity=plan["unit_granularity"],
            predicted_step_s=plan["predicted_step_s"],
            calibrated_predicted_step_s=runtime["calibrated_predicted_step_s"],
            compute_wait_s=runtime["compute_wait_s"]))
        handle.remove()
        _progress(rows[-1])
    model.to(device)
    rows.append(_row(fmt, "resident (again)", None, again := _timed(model, x, args, device, keep_output=True),
                     resident.step_s, ref, model, device, None))
    del again
    model.to("cpu")
    _progress(rows[-1])
    if args.ddo and fmt != "bf16":
        rows.append(_ddo_row(model, fmt, args.budgets[0], x, ref, resident.step_s, args, device))
        _progress(rows[-1])
    return rows


def _progress(row: dict[str, Any]) -> None:
    """One line per row as it finishes (a long run shows where it is)."""
    what = row.get("error") or (f"step {row['step_s']:.3f} s (host {row['host_s']:.3f} s), {row['ratio']:.2f}x, "
                                f"exact {row['exact']}")
    at = f" @ {row['budget'] / 2**30:.2f} GiB" if row.get("budget") else ""
    print(f"{row['format']} {row['route']}{at}: {what}", flush=True)


def _ddo_row(model: torch.nn.Module, fmt: str, budget: int, x: dict[str, Any], ref: torch.Tensor, resident_s: float,
             args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The original DDO on this model (it keeps it: call last). A failure is a row that says why."""
    from benchmarks.rows import _ddo_env
    from benchmarks.worker import _attach_ddo

    rss0 = _resident_rss(model, device)
    # route="dynamic_offload": DDO's own runtime, which takes SDNQ layers to its sdnq_runtime (its auto
    # route hands quantized modules to diffusers group offloading instead)
    spec = {"preset": "one_shot_fast", "route": "dynamic_offload", "env": _ddo_env(budget)}
    try:
        attached = _attach_ddo(model, spec, device, None)
        timing = _timed(attached.module, x, args, device, after_warmup=_peak_reset(device), keep_output=True)
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
        return {"format": fmt, "route": "ddo", "budget": budget, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return _row(fmt, "ddo " + str(attached.info.get("ddo_route")), budget, timing, resident_s, ref, model, device,
                rss0, call=attached.info.get("call"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ddo_blocks.streaming.bandwidth import link_bytes_per_s

    device = torch.device(args.device)
    link = link_bytes_per_s(device)
    base = _build(args, device)
    rows: list[dict[str, Any]] = []
    for fmt in args.formats:
        model = base if fmt == "bf16" else _quantize(copy.deepcopy(base), fmt, device, args.tiny)
        rows += _rows_for(model, fmt, args, device, link)
        if model is not base:
            del model
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.sdnq " + " ".join(args.argv), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "link_gb_s": link / 1e9, "repeats": args.repeats, "rows": rows}


def markdown(doc: dict[str, Any]) -> str:
    from ddo_blocks import fmt_bytes

    lines = [f"# SDNQ packed route vs bf16 streaming ({doc['gpu'] or doc['device']}, torch {doc['torch']})", "",
             f"- date: {doc['date']}; command: `{doc['command']}`; link {doc['link_gb_s']:.1f} GB/s; step = median of "
             f"{doc['repeats']} timed calls after two warm-up calls (host s: until each call returned); roofline = max(the format's resident step, streamed bytes "
             "/ link)", "",
             "| format | route | budget | step s | host s | roofline s | step / roofline | calibrated s | units | slots "
             "| streamed | peak GPU alloc | host slabs / weights | host RSS / slabs | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        budget = fmt_bytes(r["budget"]) if r["budget"] else "-"
        if r.get("error"):
            lines.append(f"| {r['format']} | {r['route']} | {budget} | failed: {r['error']} |" + " |" * 11)
            continue
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "1.00x"
        slabs = f"{r['host_slab_bytes'] / r['weight_bytes']:.2f}" if r.get("host_slab_bytes") else "-"
        rss = r.get("host_rss_bytes")
        per_slab = f"{rss / r['host_slab_bytes']:.3f}" if rss is not None and r.get("host_slab_bytes") else (
            fmt_bytes(rss) if rss is not None else "-")
        cal = r.get("calibrated_predicted_step_s")
        host = f"{r['host_s']:.3f}" if r.get("host_s") is not None else "-"
        units = f"{r['units']} {r['granularity']}" if r.get("units") else "-"
        lines.append(f"| {r['format']} | {r['route']} | {budget} | {r['step_s']:.3f} | {host} | {r['roofline_s']:.3f} | "
                     f"{ratio} | {f'{cal:.3f}' if cal else '-'} | {units} | {r.get('slots', '-')} | "
                     f"{fmt_bytes(r.get('streamed_bytes'))} | "
                     f"{fmt_bytes(r.get('peak_gpu_allocated'))} | {slabs} | {per_slab} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="python -m benchmarks.sdnq", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budgets", default="2,4,8", help="GiB, or sizes such as 512MiB (default 2,4,8)")
    p.add_argument("--formats", default="bf16,int8,uint4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="ddo_blocks' tiny transformer (CPU, tests)")
    p.add_argument("--units", default="auto", help="unit granularity of our rows: auto, block or child")
    p.add_argument("--ddo", action="store_true", help="also the original DDO at the first budget (last per format)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.budgets = [parse_size(b) for b in args.budgets.split(",")]
    args.formats = args.formats.split(",")
    doc = run(args)
    return write_rows(args.out, "sdnq", doc, markdown(doc))


if __name__ == "__main__":
    raise SystemExit(main())
