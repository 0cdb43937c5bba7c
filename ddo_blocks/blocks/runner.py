"""Running a staged Modular pipeline with DDO blocks from the command line: the shared part of
``make run`` (``ddo_blocks.mainjob``) and the scripts in ``pipelines/``.

Every stage takes ``--<stage>-route``, ``--<stage>-preset`` and ``--<stage>-budget``; ``--model PATH``
takes a Diffusers model directory (the default is the embedded tiny model, generated once into
``.ddo_cache/``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import routes
from ..budget import fmt_bytes
from ..errors import ConfigError
from ..report import Report
from ..streaming.coded import CODECS
from .block import REPORTS_KEY, remove_offload, validate
from .policy import PIPELINE_PRESETS
from .wrap import wrap

STAGES = ("text_encoder", "denoise", "decode")
SCHEMA = "ddo_blocks.pipeline_report/1"


@dataclass
class StageDefaults:
    """The command line's default policy for each stage (``None``: the pipeline preset's)."""

    routes: dict[str, str] = field(default_factory=dict)
    presets: dict[str, str] = field(default_factory=dict)
    budgets: dict[str, str] = field(default_factory=dict)

    def describe(self, stage: str) -> str:
        bits = [self.routes.get(stage), self.presets.get(stage)]
        budget = self.budgets.get(stage)
        text = "/".join(b for b in bits if b) or "the preset's"
        return text + (f", budget {budget}" if budget else "")


def add_arguments(p: argparse.ArgumentParser, *, family: str, defaults: StageDefaults | None = None,
                  output: str = "image") -> None:
    """Adds the model, device and per-stage policy options."""
    defaults = defaults or StageDefaults()
    p.set_defaults(stage_defaults=defaults)
    p.add_argument("--model", metavar="PATH", default=None,
                   help=f"a Diffusers model directory (model_index.json + component folders). Default: the "
                        f"embedded tiny {family} model, generated once into .ddo_cache/ ($DDO_CACHE_DIR)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--preset", default="auto", choices=PIPELINE_PRESETS,
                   help="pipeline preset: the default policy of every stage not set below (default: auto, "
                        "which here means: " + "; ".join(f"{s} {defaults.describe(s)}" for s in STAGES)
                        + "; docs/blocks.md has the table)")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="with --preset vmm_fast (or stages on route vmm): the one VRAM budget the stages share, "
                        "e.g. 16GiB")
    for stage in STAGES:
        flag = stage.replace("_", "-")
        g = p.add_argument_group(f"{stage} stage")
        g.add_argument(f"--{flag}-route", dest=f"{stage}_route", default=None,
                       choices=[n for n, spec in routes.REGISTRY.items() if not spec.needs_files],
                       help=f"route for the {stage} components (default with --preset auto: "
                            f"{defaults.describe(stage)})")
        g.add_argument(f"--{flag}-preset", dest=f"{stage}_preset", default=None,
                       help="preset of that route (default: the route's auto); `python -m ddo_blocks presets`")
        g.add_argument(f"--{flag}-budget", dest=f"{stage}_budget", default=None,
                       help="VRAM budget per component for the routes that stream, e.g. 6GiB; 'min' for the "
                            "smallest plan (the always-resident weights plus two slots of the largest unit, "
                            "blocks or their children, whichever needs less); 'auto': half the free device "
                            "memory, then what the first call's activations leave")
        g.add_argument(f"--{flag}-codec", dest=f"{stage}_codec", default=None, choices=CODECS,
                       help="lossless compressed transfer for the linear route, decoded on the GPU: fixed = bf16 "
                            "weights sent at 12 bits, tiered = at about 11, huffman = at about 10.65, lossless = the "
                            "planner chooses "
                            "(default: off)")
        g.add_argument(f"--{flag}-graph", dest=f"{stage}_graph", action="store_true", default=None,
                       help="linear route: replay the stage's steady calls as CUDA graphs (default: off)")
        if stage != "denoise":
            g.add_argument(f"--{flag}-offload-type", dest=f"{stage}_offload_type", default=None,
                           choices=("leaf_level", "block_level"),
                           help="offload_type for route diffusers (default: the preset's)")
    p.add_argument("--prompt", default="a photo of an astronaut riding a horse", help="the prompt")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 2 on the tiny model, "
                                                           "the pipeline's own otherwise)")
    p.add_argument("--height", type=int, default=None, help="height (default: the model's)")
    p.add_argument("--width", type=int, default=None, help="width (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="load the weights in this dtype (default: as saved)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the pipeline without offloading and compare the outputs bit for bit "
                        "(default: on for the tiny model, off for --model)")
    p.add_argument("--out", default="outputs", help=f"where the {output} and report JSON go (default: outputs/)")


def minimum_budget(module: torch.nn.Module, codec: str = "off") -> int:
    """The smallest linear-route budget for ``module`` (see :func:`ddo_blocks.minimum_budget`)."""
    from ..api import minimum_budget as api_minimum_budget

    return api_minimum_budget(module, codec=codec)


def stage_policies(args: argparse.Namespace, components: dict[str, Any], blocks: Any) -> dict[str, Any]:
    """The per-stage policies the command line asks for (``None``: the preset's default)."""
    out: dict[str, Any] = {}
    for stage in STAGES:
        if stage not in blocks.sub_blocks:
            continue
        job: StageDefaults = getattr(args, "stage_defaults", None) or StageDefaults()
        use_job = args.preset == "auto"
        route = getattr(args, f"{stage}_route", None)
        preset = getattr(args, f"{stage}_preset", None)
        budget = getattr(args, f"{stage}_budget", None)
        offload_type = getattr(args, f"{stage}_offload_type", None)
        codec = getattr(args, f"{stage}_codec", None)
        graph = getattr(args, f"{stage}_graph", None)
        if use_job and route is None:
            route = job.routes.get(stage)
            preset = preset if preset is not None else job.presets.get(stage)
            budget = budget if budget is not None else job.budgets.get(stage)
        if budget in ("min", "auto") and route is not None and not routes.get(route).streams:
            streaming = ", ".join(n for n, spec in routes.REGISTRY.items() if spec.streams)
            raise ConfigError(f"--{stage.replace('_', '-')}-budget {budget} applies to the routes that stream "
                              f"({streaming}); route {route!r} was asked")
        if route is None and preset is None and budget is None and offload_type is None and codec is None and not graph:
            continue
        policy: dict[str, Any] = {}
        if route is not None:
            policy["route"] = route
        if preset is not None:
            policy["preset"] = preset
        if offload_type is not None:
            policy["offload_type"] = offload_type
            if offload_type == "block_level":
                policy["num_blocks_per_group"] = 1  # block_level needs it; the command line has no option for it
        if codec is not None:
            policy["codec"] = codec
        if graph:
            policy["graph"] = True
        if budget is not None:
            if budget == "min":
                from .block import module_components

                names = module_components(blocks.sub_blocks[stage])
                policy = {c: {**policy, "vram_budget": minimum_budget(components[c], codec or "off")}
                          for c in names if c in components}
            else:
                policy["vram_budget"] = budget
        out[stage] = policy
    return out


JOBS = {"flux": "python -m ddo_blocks run (or pipelines/flux_t2i.py)", "sd3": "pipelines/sd3_t2i.py",
        "wan": "pipelines/wan_t2v.py"}
"""The staged script for each model family."""


def check_model_family(path: Path, family: str) -> None:
    """Refuses a model directory of another family, naming what it holds and what would run it."""
    from ..tiny_pipeline import _PIPELINE_CLASS

    index = path / "model_index.json"
    if not index.is_file():
        raise ConfigError(f"--model {path}: no model_index.json there; pass a Diffusers model directory")
    try:
        found = json.loads(index.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"--model {path}: model_index.json is not a JSON object ({exc})") from None
    expected = _PIPELINE_CLASS[family]
    prefix = expected.removesuffix("Pipeline")
    if not isinstance(found, str) or not found.startswith(prefix):
        other = next((f for f, cls in _PIPELINE_CLASS.items() if isinstance(found, str)
                      and found.startswith(cls.removesuffix("Pipeline"))), None)
        hint = f"; run it with {JOBS[other]}" if other else ""
        raise ConfigError(
            f"--model {path} holds a {found or 'pipeline of unknown class'} (model_index.json _class_name), and "
            f"this job runs a {expected} ({family}) model{hint}"
        )


def _to_dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def run(
    args: argparse.Namespace,
    *,
    family: str,
    make_blocks: Callable[[], Any],
    output: str = "images",
    call_kwargs: dict[str, Any] | None = None,
    save: Callable[[Any, Path], Path] | None = None,
) -> int:
    """Loads the model, wraps ``make_blocks()`` with the asked policies, runs it, prints each block's
    report, writes the output and the report JSON, and says where. Returns the exit code."""
    from ..tiny_pipeline import CALL_DEFAULTS, ensure_tiny_model, load_components

    tiny = args.model is None
    path = ensure_tiny_model(family) if tiny else Path(args.model)
    if not tiny:
        check_model_family(path, family)
    print(f"model: {'embedded tiny ' + family + ' model at ' if tiny else ''}{path}")
    kwargs: dict[str, Any] = dict(CALL_DEFAULTS[family]) if tiny else {}
    kwargs.update(call_kwargs or {})
    for key, value in (("num_inference_steps", args.steps), ("height", args.height), ("width", args.width)):
        if value is not None:
            kwargs[key] = value
    dtype = _to_dtype(args.dtype)
    components = load_components(path, dtype=dtype)
    blocks = make_blocks()
    policies = stage_policies(args, components, blocks)
    vmm = routes.get("vmm").preset_map
    budget = getattr(args, "vram_budget", None)
    if args.preset in vmm and budget is None:
        raise ConfigError(f"--preset {args.preset} shares one VRAM budget between the stages: pass --vram-budget SIZE "
                          "(e.g. 16GiB)")
    wrapped = wrap(blocks, device=args.device, preset=args.preset, **policies,
                   **({"vram_budget": budget} if budget is not None or args.preset in vmm else {}))
    pipe = wrapped.init_pipeline()
    pipe.update_components(**components)
    validate(pipe)  # every stage's policy against its components, before the first stage runs
    for name, block in wrapped.sub_blocks.items():
        desc = getattr(block, "component_policies", None)
        if desc:
            print(f"  {name:<13} " + "; ".join(f"{c}: {p.describe()}" for c, p in desc.items()))

    def call(p: Any) -> Any:
        gen = torch.Generator("cpu").manual_seed(args.seed)
        return p(prompt=args.prompt, generator=gen, output_type="pt", **kwargs)

    try:
        state = call(pipe)
    finally:
        remove_offload(pipe)
    result = state.get(output)
    reports: dict[str, dict[str, Report]] = state.get(REPORTS_KEY) or {}
    for stage, per in reports.items():
        for comp, rep in per.items():
            print()
            print(f"[{stage}] {comp}")
            print(rep)
    check = args.check if args.check is not None else tiny
    exact: bool | None = None
    if check:
        plain = make_blocks().init_pipeline()
        plain.update_components(**components)
        if args.device != "cpu":
            plain.to(args.device)
        reference = call(plain).get(output)
        exact = bool(torch.equal(_as_tensor(result).cpu(), _as_tensor(reference).cpu()))
        print()
        print(f"output equals the same pipeline without offloading: {'yes' if exact else 'NO'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = (save or save_images)(result, out)
    record = {
        "schema": SCHEMA,
        "model": str(path),
        "tiny": tiny,
        "device": args.device,
        "call": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, str))},
        "exact": exact,
        "stages": {stage: {c: r.to_dict() for c, r in per.items()} for stage, per in reports.items()},
    }
    report_path = out / f"report_{family}.json"
    report_path.write_text(json.dumps(record, indent=2))
    total = sum(r["plan"].get("gpu_bytes") or 0 for per in reports.values() for r in per.values())
    print(f"\n{output} written to {saved.resolve()}")
    print(f"report written to {report_path.resolve()}  (planned device bytes, all stages: {fmt_bytes(total)})")
    return 0 if exact is not False else 1


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        return torch.stack([_as_tensor(v) for v in x])
    return torch.as_tensor(x)


def save_images(images: Any, out: Path, name: str = "image") -> Path:
    """Saves the first image of a ``(B, C, H, W)`` tensor in [0, 1] as PNG."""
    from PIL import Image

    t = _as_tensor(images)[0].detach().float().clamp(0, 1).cpu()
    array = (t.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    path = out / f"{name}.png"
    Image.fromarray(array).save(path)
    return path


def save_video(videos: Any, out: Path, name: str = "video") -> Path:
    """Saves the first video of a ``(B, F, C, H, W)`` tensor in [0, 1] as an animated GIF."""
    from PIL import Image

    t = _as_tensor(videos)[0].detach().float().clamp(0, 1).cpu()
    frames = [Image.fromarray((f.permute(1, 2, 0).numpy() * 255).round().astype("uint8")) for f in t]
    path = out / f"{name}.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=125, loop=0)
    return path
