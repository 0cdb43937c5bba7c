"""The SDNQ packed route against the same transformer streamed in bf16, in one process.

A Flux-dev-sized transformer with random weights (seeded, built on the device in bf16) is streamed
as is on the linear route, then quantized with SDNQ (int8, uint4; ``sdnq`` must be installed: it is
GPL-3.0 and only this script and the tests use it) and streamed packed on the sdnq route, at each
budget. Every format's roofline is ``max(its resident compute, streamed bytes / link)``, its
resident compute measured in the same process; each offloaded step is compared with that format's
resident output (``torch.equal``). Rows share one process (not isolated as in benchmarks.run), so
host RSS is not reported per row: host memory is the slabs' bytes against the packed weights.

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

from benchmarks.measure import parse_size, time_forward, write_rows


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


def _rows_for(model: torch.nn.Module, fmt: str, args: argparse.Namespace, device: torch.device,
              link: float) -> list[dict[str, Any]]:
    import ddo_blocks

    x = _inputs(model, args, device)
    model.to(device)
    resident = time_forward(lambda **kw: model(**kw)[0], x, device, repeats=args.repeats, keep_output=True)
    ref = resident.output
    model.to("cpu")
    rows = [{"format": fmt, "route": "resident", "budget": None, "step_s": resident.step_s,
             "roofline_s": resident.step_s, "exact": True, "weight_bytes": _weights(model)}]
    route = "linear" if fmt == "bf16" else "sdnq"
    for budget in args.budgets:
        handle = ddo_blocks.offload(model, route=route, vram_budget=budget, device=device, component="transformer")
        peaks: dict[str, int] = {}

        def reset() -> None:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

        timing = time_forward(lambda **kw: model(**kw)[0], x, device, repeats=args.repeats, after_warmup=reset,
                              keep_output=True)
        if device.type == "cuda":
            peaks["gpu"] = torch.cuda.max_memory_allocated(device)
        rep = handle.report()
        streamed = rep["plan"]["streamed_bytes"]
        roof = max(resident.step_s, streamed / link)
        rows.append({"format": fmt, "route": handle.route, "budget": budget, "step_s": timing.step_s,
                     "first_call_s": timing.first_call_s, "roofline_s": roof, "ratio": timing.step_s / roof,
                     "streamed_bytes": streamed, "gpu_bytes": rep["plan"]["gpu_bytes"],
                     "peak_gpu_allocated": peaks.get("gpu"), "host_slab_bytes": rep["plan"]["host_slab_bytes"],
                     "pinned_bytes": rep["memory"]["pinned_bytes"], "weight_bytes": _weights(model),
                     "exact": bool(torch.equal(timing.output, ref)), "report_efficiency": rep["roofline"]["efficiency"]})
        handle.remove()
    return rows


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
             f"{doc['repeats']} timed calls after a warm-up; roofline = max(the format's resident step, streamed bytes "
             "/ link)", "",
             "| format | route | budget | step s | roofline s | step / roofline | streamed | peak GPU alloc | "
             "host slabs / weights | exact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        budget = fmt_bytes(r["budget"]) if r["budget"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "1.00x"
        slabs = f"{r['host_slab_bytes'] / r['weight_bytes']:.2f}" if r.get("host_slab_bytes") else "-"
        lines.append(f"| {r['format']} | {r['route']} | {budget} | {r['step_s']:.3f} | {r['roofline_s']:.3f} | {ratio} | "
                     f"{fmt_bytes(r.get('streamed_bytes'))} | {fmt_bytes(r.get('peak_gpu_allocated'))} | {slabs} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="python -m benchmarks.sdnq", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budgets", default="2,4,8", help="GiB, or sizes such as 512MiB (default 2,4,8)")
    p.add_argument("--formats", default="bf16,int8,uint4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="ddo_blocks' tiny transformer (CPU, tests)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.budgets = [parse_size(b) for b in args.budgets.split(",")]
    args.formats = args.formats.split(",")
    doc = run(args)
    return write_rows(args.out, "sdnq", doc, markdown(doc))


if __name__ == "__main__":
    raise SystemExit(main())
