"""The main job of ``make run``: the staged Flux-architecture Modular pipeline with DDO blocks.

By default it runs the embedded tiny Flux model (generated once from a config into ``.ddo_cache/``
and loaded with diffusers' ``from_pretrained``) with mixed routes: Diffusers leaf offloading for the
text encoders, the linear route for the transformer with the smallest budget (every block streams),
the VAE resident. It prints each block's report, checks the image against the same pipeline without
offloading, writes the image and the report JSON, and says where. ``--model PATH`` runs a real
Diffusers Flux directory the same way (on a GPU).

The transformer-only job this replaced is ``run_transformer`` below (kept for its exactness check).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from . import offload
from .budget import fmt_bytes, parse_bytes
from .tiny import flux_inputs, tiny_flux_transformer


def add_transformer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--route", default="linear", help="route for the transformer (default: linear)")
    p.add_argument("--preset", default="auto", help="preset (default: auto); see `python -m ddo_blocks presets`")
    p.add_argument("--vram-budget", default=None,
                   help="VRAM budget for the transformer, e.g. 6GiB (default: the minimum that streams every block)")
    p.add_argument("--steps", type=int, default=4, help="forward calls, like denoising steps (default: 4)")
    p.add_argument("--out", default="outputs", help="where the report JSON goes (default: outputs/)")


def run_transformer(args: argparse.Namespace) -> int:
    from . import _native

    model = tiny_flux_transformer()
    inputs = flux_inputs(model, device="cpu")
    with torch.no_grad():
        reference = model(**inputs)[0]
    budget = parse_bytes(args.vram_budget)
    if budget is None:
        # the tightest budget: always-resident weights + two slots; every block streams
        from .units import split_units, tensor_nbytes

        units, leftovers = split_units(model)
        base = sum(tensor_nbytes(p) for _, p in leftovers) + sum(tensor_nbytes(b) for b in model.buffers())
        sizes = [_native.layout_unit([tensor_nbytes(p) for _, p in u.params])[1] for u in units]
        budget = _native.minimum_budget(sizes, base)
    handle = offload(model, route=args.route, preset=args.preset, vram_budget=budget, device=args.device,
                     component="transformer")
    dev_inputs = {k: (v.to(handle.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    with torch.no_grad():
        outs = [model(**dev_inputs)[0] for _ in range(args.steps)]
    exact = all(torch.equal(o.cpu(), reference) for o in outs)
    report = handle.report()
    print(report)
    print()
    print(f"offloaded output equals the resident output over {args.steps} calls: {'yes' if exact else 'NO'}")
    print(f"budget {fmt_bytes(budget)}; the plan keeps {fmt_bytes(report['plan'].get('gpu_bytes'))} on {handle.device}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report_transformer.json"
    path.write_text(json.dumps(report.to_dict(), indent=2))
    handle.remove()
    print(f"report written to {path.resolve()}")
    return 0 if exact else 1


# -------------------------------------------------------------------------------------------------
# the main job: the staged Flux Modular pipeline
# -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m ddo_blocks run`` (``make run ARGS=...``)."""
    from .blocks.runner import StageDefaults
    from .blocks.runner import add_arguments as add_pipeline_arguments

    p.description = (
        "Run the staged Flux Modular pipeline (text_encoder -> denoise -> decode), each stage wrapped in "
        "a DDO block with its own route, preset and VRAM budget; print each block's report and write the "
        "image and the report JSON."
    )
    add_pipeline_arguments(
        p,
        family="flux",
        defaults=StageDefaults(
            routes={"text_encoder": "diffusers", "denoise": "linear", "decode": "resident"},
            presets={"text_encoder": "diffusers_leaf_offload_compat"},
            budgets={"denoise": "min"},
        ),
    )


def run(args: argparse.Namespace) -> int:
    from diffusers.modular_pipelines import FluxAutoBlocks

    from .blocks.runner import run as run_pipeline

    return run_pipeline(args, family="flux", make_blocks=FluxAutoBlocks, output="images")
