"""``python -m benchmarks.run``: one forward of a Flux-dev-sized transformer through every offload
route, each row (route, preset, budget) in its own process. See benchmarks/README.md.

Scheme (the fastest one that keeps every row isolated):

1. one *builder* process makes the random weights on the device and writes them into an in-memory
   blob (memfd), then measures the link and host-copy bandwidth;
2. this process reads the blob into ordinary CPU tensors once (plain ``preadv`` threads, no CUDA,
   no torch kernels) and then ``fork()``\\ s one child per row: the child starts with the loaded
   model (copy-on-write), initialises CUDA, attaches its route, runs the warm-up and the timed
   forwards and writes its row; peak GPU memory and host RSS are that child's alone;
3. where forking is not safe (CUDA already initialised here, or a child fails to initialise it)
   the rows run as fresh interpreters (``spawn``) that read the blob themselves.
"""

from __future__ import annotations

import os

# torch's CUDA availability check must not initialise the driver in this process (it forks CUDA
# children); with this set it asks NVML instead. Set before torch is imported.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import argparse
import datetime
import importlib.metadata
import importlib.util
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import ROOT
from . import results as R
from .isolation import Runner, choose_isolation, import_diffusers
from .measure import GIB
from .rows import expand_routes, make_specs, parse_budget

FLUX_DEV_BYTES = 22.17 * GIB

EST_GPU_S = {
    "build": 40,
    "resident": 12,
    "ours:one_shot_fast": 15,
    "ours:warm_process": 18,
    "ours:low_ram_safe": 22,
    "ours": 16,
    "diffusers:block_level": 65,
    "diffusers:leaf_level": 45,
    "ddo:one_shot_fast": 30,
    "ddo:low_ram_safe": 40,
    "ddo": 30,
}
"""Seconds one row takes on the H200 for the 22 GiB model (fork isolation), for the time limit
before a family has been measured; scaled by model size."""


# -------------------------------------------------------------------------------------------------
# arguments
# -------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Offload benchmark: one forward of a Flux-dev-sized transformer per route, preset and budget, "
        "each in its own process. Writes results.json, results.md and results.png.",
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny Flux config (2+3 blocks, 32 wide) with small defaults: runs on the CPU in seconds",
    )
    g = p.add_argument_group("model (defaults: Flux-dev; --tiny: ddo_blocks.tiny)")
    g.add_argument("--double-layers", type=int, help="double-stream blocks (Flux-dev 19)")
    g.add_argument("--single-layers", type=int, help="single-stream blocks (Flux-dev 38)")
    g.add_argument("--heads", type=int, help="attention heads (Flux-dev 24); width = heads x head-dim")
    g.add_argument("--head-dim", type=int, help="attention head dim (Flux-dev 128)")
    g.add_argument("--joint-dim", type=int, help="text embedding width (Flux-dev 4096)")
    g.add_argument("--pooled-dim", type=int, help="pooled embedding width (Flux-dev 768)")
    g.add_argument("--in-channels", type=int, help="packed latent channels (Flux-dev 64)")
    g.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weight dtype (default bf16)"
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("workload")
    g.add_argument(
        "--resolution",
        type=int,
        help="image side in pixels; image tokens = (resolution/16)^2 (default 1024 -> 4096; --tiny 128)",
    )
    g.add_argument("--text-tokens", type=int, help="text tokens (default 512; --tiny 16)")
    g.add_argument(
        "--repeats", type=int, default=5, help="timed forwards per row; the step is their median (default 5)"
    )
    g.add_argument(
        "--warmup", type=int, default=1, help="untimed forwards first; the first is 'first call' (default 1)"
    )
    g = p.add_argument_group("rows")
    g.add_argument(
        "--routes",
        default="all",
        help="comma list of: all, resident, ours (= linear), ours:PRESET, diffusers, diffusers:block_level, "
        "diffusers:leaf_level, ddo, ddo:one_shot_fast, ddo:low_ram_safe (default all); ROUTE@B1/B2 runs "
        "that route at its own budgets instead of --budgets (ours:one_shot_fast@7/16); ours:PRESET+CODEC runs a "
        "preset with a codec (ours:one_shot_fast+fixed: weights coded at 12 bits, decoded on the GPU)",
    )
    g.add_argument(
        "--budgets",
        help="weight budgets for ours and DDO one_shot_fast: sizes (bare numbers are GiB: 2,4,8; or "
        "512MiB, 1.5GB), fractions of the weights (0.25x) or 'min' (our planner's minimum). "
        "Default 2,4,8,12,16; --tiny: min,0.85x",
    )
    g.add_argument(
        "--ddo-low-ram-budgets", help="DDO low_ram_safe resident budgets (default 4; --tiny 0.85x)"
    )
    g = p.add_argument_group("running")
    g.add_argument(
        "--isolation",
        default="auto",
        choices=["auto", "fork", "spawn"],
        help="fork: children of this process, which holds the loaded model (fast; the default where "
        "safe); spawn: fresh interpreters that load the model themselves",
    )
    g.add_argument(
        "--time-limit",
        type=float,
        help="seconds for the whole run; rows that would not finish in time are skipped and listed "
        "with the command that runs them (default 480 on cuda, none on cpu; 0 = none)",
    )
    g.add_argument(
        "--row-timeout", type=float, default=240, help="seconds before a row's process is killed (240)"
    )
    g.add_argument("--bw-bytes", help="size of the bandwidth copies (default 1GiB on cuda, 64MiB on cpu)")
    g.add_argument(
        "--bw-threads",
        default="1,4,8,16",
        help="host copy thread counts (default 1,4,8,16; low_ram_safe stages with up to 16)",
    )
    g.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth measurement")
    g.add_argument("--load-threads", type=int, default=8, help="threads reading the weight blob (default 8)")
    g.add_argument("--cache-dir", help="keep the weight blob in a (deleted) file here instead of a memfd")
    g.add_argument("--dry-run", action="store_true", help="print the rows and the time estimate, run nothing")
    g = p.add_argument_group("output")
    g.add_argument("--out", help="output folder (default OUT_ROOT/<date>-<machine>)")
    g.add_argument(
        "--out-root",
        default=str(ROOT / "benchmarks" / "results"),
        help="where <date>-<machine>/ goes (default benchmarks/results)",
    )
    g.add_argument("--no-plot", action="store_true", help="skip results.png")
    g.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="merge the results.json of these runs into --out (or DIR1-merged) and exit",
    )
    return p


def model_config(a: argparse.Namespace) -> dict[str, Any]:
    from .model import FLUX_DEV, TINY

    cfg = dict(TINY if a.tiny else FLUX_DEV)
    for arg, key in (
        ("double_layers", "num_layers"),
        ("single_layers", "num_single_layers"),
        ("heads", "num_attention_heads"),
        ("head_dim", "attention_head_dim"),
        ("joint_dim", "joint_attention_dim"),
        ("pooled_dim", "pooled_projection_dim"),
        ("in_channels", "in_channels"),
    ):
        v = getattr(a, arg)
        if v is not None:
            cfg[key] = v
    if a.head_dim is not None and sum(cfg["axes_dims_rope"]) != cfg["attention_head_dim"]:
        hd = cfg["attention_head_dim"]
        a0 = hd // 8
        rest = hd - a0
        cfg["axes_dims_rope"] = (a0, rest // 2 - (rest // 2) % 2, rest - (rest // 2 - (rest // 2) % 2))
    cfg["axes_dims_rope"] = list(cfg["axes_dims_rope"])
    return cfg


# -------------------------------------------------------------------------------------------------
# versions, output folder, row lines
# -------------------------------------------------------------------------------------------------
def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, dist in (("diffusers", "diffusers"), ("ddo_rc2", "diffusers-dynamic-offloader")):
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = None
    try:
        import ddo_blocks

        out["ddo_blocks"] = ddo_blocks.__version__
        out["ddo_blocks_path"] = str(Path(ddo_blocks.__file__).parent)
    except Exception as exc:  # noqa: BLE001
        out["ddo_blocks"] = f"import failed: {exc}"
    try:
        out["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=str(ROOT),
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def _out_dir(a: argparse.Namespace, machine: dict[str, Any], now: datetime.datetime) -> Path:
    if a.out:
        return Path(a.out)
    name = f"{now:%Y-%m-%d}-{_slug(machine.get('gpu_name') or 'cpu')}" + ("-tiny" if a.tiny else "")
    root = Path(a.out_root)
    out = root / name
    i = 2
    while (out / "results.json").exists():
        out = root / f"{name}-{i}"
        i += 1
    return out


def _fmt_row(r: dict[str, Any]) -> str:
    name = (
        f"{r.get('route')} {r.get('preset') or r.get('offload_type') or ''} {r.get('budget') or ''}".strip()
    )
    if r.get("status") != "ok":
        return f"{name}: {r.get('status')} {r.get('error') or r.get('note') or ''}"
    gpu = r.get("gpu_peak_allocated")
    return (
        f"{name}: step {r['step_s']:.3f} s, first {r.get('first_call_s', 0):.2f} s, setup {r.get('setup_s', 0):.2f} s, "
        + (f"peak GPU {gpu / GIB:.2f} GiB, " if gpu is not None else "")
        + f"peak RSS {r.get('host_peak_rss', 0) / GIB:.2f} GiB"
    )


# -------------------------------------------------------------------------------------------------
# the plan: model, rows, what every job gets, the results document
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelPlan:
    """The model of the run, as laid out in the weight blob (built on the meta device, no weights)."""

    cfg: dict[str, Any]
    dtype: Any
    entries: list[dict[str, Any]]
    blob_bytes: int
    weight_bytes: int
    minimum: int | None
    """Our planner's minimum budget (``min``), ``None`` where it cannot be computed here."""
    description: str

    def budget(self, token: str) -> tuple[str, int]:
        return parse_budget(token, self.weight_bytes, self.minimum)

    def budgets(self, text: str) -> list[tuple[str, int]]:
        return [self.budget(t) for t in text.split(",")]


@dataclass(frozen=True)
class Workload:
    """One forward's inputs: image tokens per side and text tokens."""

    resolution: int
    side: int
    text_tokens: int

    @classmethod
    def of(cls, a: argparse.Namespace) -> Workload:
        resolution = a.resolution or (128 if a.tiny else 1024)
        return cls(resolution, max(1, resolution // 16), a.text_tokens or (16 if a.tiny else 512))


@dataclass
class Run:
    """One run of the harness: its arguments, model, rows, and the results document the rows fill."""

    a: argparse.Namespace
    argv: list[str]
    now: datetime.datetime
    t_start: float
    cuda: bool
    time_limit: float
    model: ModelPlan
    workload: Workload
    specs: list[dict[str, Any]]
    skips: dict[str, str]
    """Rows skipped before they run (row id: why)."""
    isolation: str
    ctx: dict[str, Any]
    """What every job gets."""
    doc: dict[str, Any]
    """results.json."""

    @property
    def notes(self) -> list[str]:
        return self.doc["notes"]

    @property
    def config(self) -> dict[str, Any]:
        return self.doc["config"]

    @property
    def scale(self) -> float:
        """The model's size against Flux-dev's (for the time estimates)."""
        return max(0.02, self.model.weight_bytes / FLUX_DEV_BYTES)

    def estimate_s(self, selector: str, observed: dict[str, list[float]], isolation: str) -> float:
        """Seconds a row of this family will take: 1.1 x its measured mean, else :data:`EST_GPU_S`
        scaled by the model size."""
        if observed.get(selector):
            return 1.1 * sum(observed[selector]) / len(observed[selector])
        est = 1.0 + EST_GPU_S.get(selector, EST_GPU_S.get(selector.split(":")[0], 20)) * self.scale
        if isolation == "spawn":
            est += 6 + 6 * self.scale
        return est if self.cuda else 0.5 + est * 0.1


def _minimum_budget(meta: Any) -> int | None:
    try:
        from ddo_blocks import _native
        from ddo_blocks.units import split_units, tensor_nbytes

        units, left = split_units(meta)
        base = sum(tensor_nbytes(p) for _, p in left) + sum(tensor_nbytes(b) for b in meta.buffers())
        return _native.minimum_budget(
            [_native.layout_unit([tensor_nbytes(p) for _, p in u.params]).nbytes for u in units], base
        ).bytes
    except Exception as exc:  # noqa: BLE001
        print(f"note: ddo_blocks is not importable here ({exc}); budget 'min' unavailable", file=sys.stderr)
        return None


def plan_model(a: argparse.Namespace) -> ModelPlan:
    from . import model as M

    cfg = model_config(a)
    dtype = M.dtype_of(a.dtype)
    meta = M.skeleton(cfg, dtype)
    entries, blob_bytes = M.layout(meta)
    heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
    desc = (
        f"FluxTransformer2DModel {cfg['num_layers']}+{cfg['num_single_layers']} blocks, "
        f"width {heads * head_dim} ({heads}x{head_dim})" + (" [tiny]" if a.tiny else "")
    )
    return ModelPlan(cfg, dtype, entries, blob_bytes, M.weight_bytes(meta), _minimum_budget(meta), desc)


def known_skips(specs: list[dict[str, Any]], cuda: bool, versions: dict[str, Any]) -> dict[str, str]:
    """The rows that cannot run here, and why: DDO rc2 needs CUDA and its package; our routes that
    need CUDA (``RouteSpec.needs_cuda``: vmm) need it too."""
    from ddo_blocks import routes

    skips: dict[str, str] = {}
    for s in specs:
        own = s.get("ddo_blocks_route")
        if own is not None and routes.get(own).needs_cuda and not cuda:
            skips[s["id"]] = f"route {own!r} needs a CUDA device: skipped on the CPU"
        if s["route"] != "ddo":
            continue
        if not cuda:
            skips[s["id"]] = "DDO 0.1.0rc2 needs a CUDA device: skipped on the CPU"
        elif versions.get("ddo_rc2") is None and importlib.util.find_spec("diffusers_dynamic_offloader") is None:
            skips[s["id"]] = "diffusers-dynamic-offloader (the original DDO) is not installed: skipped"
    return skips


def job_context(a: argparse.Namespace, model: ModelPlan, w: Workload, cuda: bool) -> dict[str, Any]:
    return {
        "device": a.device,
        "cfg": model.cfg,
        "dtype": a.dtype,
        "seed": a.seed,
        "height_tokens": w.side,
        "width_tokens": w.side,
        "text_tokens": w.text_tokens,
        "repeats": a.repeats,
        "warmup": max(1, a.warmup),
        "weight_bytes": model.weight_bytes,
        "bw_bytes": parse_budget(a.bw_bytes, model.weight_bytes, None)[1] if a.bw_bytes else (GIB if cuda else 64 << 20),
        "bw_threads": [int(x) for x in a.bw_threads.split(",") if x.strip()],
        "bandwidth": not a.no_bandwidth,
        "load_threads": a.load_threads,
        "rss_interval_s": 0.01,
    }


def run_config(a: argparse.Namespace, model: ModelPlan, w: Workload, selectors: list[str],
               budgets: list[tuple[str, int]], ddo_low: list[tuple[str, int]], time_limit: float) -> dict[str, Any]:
    """results.json's ``config``."""
    cfg = model.cfg
    return {
        "device": a.device,
        "tiny": a.tiny,
        "dtype": a.dtype,
        "resolution": w.resolution,
        "image_tokens": w.side * w.side,
        "text_tokens": w.text_tokens,
        "repeats": a.repeats,
        "warmup": max(1, a.warmup),
        "routes": selectors,
        "budgets": [{"label": lab, "bytes": n} for lab, n in budgets],
        "ddo_low_ram_budgets": [{"label": lab, "bytes": n} for lab, n in ddo_low],
        "isolation": a.isolation,
        "time_limit_s": time_limit or None,
        "row_timeout_s": a.row_timeout,
        "seed": a.seed,
        "model": {
            "description": model.description,
            "cfg": cfg,
            "weight_bytes": model.weight_bytes,
            "blob_bytes": model.blob_bytes,
            "double_layers": cfg["num_layers"],
            "single_layers": cfg["num_single_layers"],
            "width": cfg["num_attention_heads"] * cfg["attention_head_dim"],
        },
    }


def new_doc(now: datetime.datetime, argv: list[str], versions: dict[str, Any], config: dict[str, Any],
            notes: list[str]) -> dict[str, Any]:
    """results.json before the builder: this machine's versions and facts (the builder adds the GPU's)."""
    import platform

    import psutil
    import torch

    machine: dict[str, Any] = dict(versions)
    machine.update(
        hostname=platform.node(),
        cpu_count=os.cpu_count(),
        ram_bytes=psutil.virtual_memory().total,
        python=platform.python_version(),
        torch=torch.__version__,
    )
    return {
        "schema": R.SCHEMA,
        "created": now.isoformat(timespec="seconds"),
        "command": "python -m benchmarks.run " + " ".join(shlex.quote(x) for x in argv),
        "machine": machine,
        "config": config,
        "bandwidth": None,
        "rows": [],
        "notes": notes,
    }


def plan_run(a: argparse.Namespace, argv: list[str]) -> Run:
    """Everything decided before a process starts: the model's layout, the rows, the isolation."""
    t_start, now = time.monotonic(), datetime.datetime.now(datetime.UTC)
    cuda = a.device.startswith("cuda")
    time_limit = a.time_limit if a.time_limit is not None else (480.0 if cuda else 0.0)
    import_diffusers(cuda)
    model = plan_model(a)
    budgets = model.budgets(a.budgets or ("min,0.85x" if a.tiny else "2,4,8,12,16"))
    ddo_low = model.budgets(a.ddo_low_ram_budgets or ("0.85x" if a.tiny else "4"))
    selectors = expand_routes(a.routes)
    specs = make_specs(selectors, budgets, ddo_low, model.budget)
    versions = _versions()
    skips = known_skips(specs, cuda, versions)
    isolation, why = choose_isolation(a.isolation)
    notes = sorted(set(skips.values())) + ([why] if why else [])
    w = Workload.of(a)
    doc = new_doc(now, argv, versions, run_config(a, model, w, selectors, budgets, ddo_low, time_limit), notes)
    return Run(a, argv, now, t_start, cuda, time_limit, model, w, specs, skips, isolation,
               job_context(a, model, w, cuda), doc)


def print_plan(run: Run) -> None:
    m, w = run.model, run.workload
    print(
        f"benchmark: {m.description}, {m.weight_bytes / GIB:.2f} GiB {run.a.dtype}; {w.side * w.side}+{w.text_tokens} "
        f"tokens; {len(run.specs)} rows on {run.a.device}; isolation {run.isolation}"
        + (f"; time limit {run.time_limit:.0f} s" if run.time_limit else ""),
        flush=True,
    )


def print_estimate(run: Run) -> None:
    """``--dry-run``: every row with the seconds it should take, and the total."""
    total = run.estimate_s("build", {}, run.isolation) + (3 * run.scale if run.isolation == "fork" else 0)
    for s in run.specs:
        why = run.skips.get(s["id"])
        e = 0 if why else run.estimate_s(s["selector"], {}, run.isolation)
        total += e
        print(f"  {s['id']:<40} ~{e:5.0f} s" + (f"  ({why})" if why else ""))
    print(f"estimated total: {total:.0f} s")


# -------------------------------------------------------------------------------------------------
# the run: builder, model, rows, results
# -------------------------------------------------------------------------------------------------
def run_builder(run: Run, runner: Runner) -> Path | None:
    """The builder process: the weights into the blob, the machine's facts, the bandwidth. Returns
    the output folder, or ``None`` when the build failed (results.json says why)."""
    t0 = time.monotonic()
    res = runner.run_job({"kind": "build", "ctx": run.ctx, "entries": run.model.entries},
                         timeout=max(run.a.row_timeout, 300))
    machine = run.doc["machine"]
    if res.get("status") == "error":
        print(f"error: building the model failed: {res.get('error')}\n{res.get('traceback', '')}", file=sys.stderr)
        run.notes.append(f"building the model failed: {res.get('error')}")
        run.doc["build_error"] = {k: res.get(k) for k in ("error", "traceback")}
        out = _out_dir(run.a, machine, run.now)
        R.write(run.doc, out, with_plot=False)
        print(f"wrote {out / 'results.json'}", file=sys.stderr)
        return None
    machine.update({k: v for k, v in res.get("machine", {}).items() if v is not None or k not in machine})
    run.doc["bandwidth"] = res.get("bandwidth")
    run.doc["build"] = {"build_s": res.get("build_s"), "process_s": time.monotonic() - t0}
    out = _out_dir(run.a, machine, run.now)
    out.mkdir(parents=True, exist_ok=True)
    print(_built_line(run, res, t0, out), flush=True)
    return out


def _built_line(run: Run, res: dict[str, Any], t0: float, out: Path) -> str:
    bw = run.doc["bandwidth"] or {}
    link = (
        f"pinned h2d {bw.get('pinned_h2d_gb_s', 0):.1f} GB/s, pageable {bw.get('pageable_h2d_gb_s', 0):.1f} GB/s, "
        f"host copy {bw.get('host_copy_gb_s')}; "
        if bw
        else ""
    )
    return (
        f"built {run.model.weight_bytes / GIB:.2f} GiB of weights in {res.get('build_s', 0):.1f} s "
        f"({time.monotonic() - t0:.1f} s with the process); " + link + f"results -> {out}"
    )


def load_model_here(run: Run, runner: Runner) -> None:
    """Fork isolation: the model, once, in this process (every forked row starts with it)."""
    if runner.isolation != "fork":
        return
    from . import model as M

    t0 = time.monotonic()
    m = run.model
    runner.model = M.load_model(m.cfg, m.dtype, m.entries, runner.blob_fd, run.a.load_threads)
    run.doc["build"]["parent_load_s"] = time.monotonic() - t0
    print(f"loaded the model into this process in {time.monotonic() - t0:.1f} s", flush=True)


def _over_time(run: Run, spec: dict[str, Any], observed: dict[str, list[float]], isolation: str) -> str | None:
    """Why the row would not finish within ``--time-limit``, if it would not."""
    est = run.estimate_s(spec["selector"], observed, isolation)
    elapsed = time.monotonic() - run.t_start
    if run.time_limit and elapsed + est > run.time_limit:
        return f"time limit: {elapsed:.0f} s gone, this row needs about {est:.0f} s of the {run.time_limit:.0f} s"
    return None


def skip_row(run: Run, spec: dict[str, Any], why: str, head: str) -> None:
    from .worker import stub_row

    row = stub_row(spec, "skipped", why)
    run.doc["rows"].append(row)
    print(f"{head} {_fmt_row(row)}", flush=True)


def run_row(run: Run, runner: Runner, spec: dict[str, Any], observed: dict[str, list[float]], head: str,
            out: Path) -> None:
    """One row in its own process; results.json is rewritten after it."""
    res = runner.run_job({"kind": "row", "ctx": run.ctx, "spec": spec, "entries": run.model.entries})
    if run.cuda and res.get("status") == "ok":
        runner.forked_cuda_works()
    res["selector"] = spec["selector"]
    observed.setdefault(spec["selector"], []).append(res.get("process_wall_s", 0.0))
    run.doc["rows"].append(res)
    print(f"{head} {_fmt_row(res)} ({res.get('process_wall_s', 0):.1f} s)", flush=True)
    if res.get("status") == "error" and res.get("traceback"):
        print(res["traceback"], file=sys.stderr, flush=True)
    run.config["isolation_used"] = runner.isolation
    R.write(run.doc, out, with_plot=False)


def run_rows(run: Run, runner: Runner, out: Path) -> list[dict[str, Any]]:
    """Every row in turn (or its skip); returns the specs skipped for the time limit."""
    observed: dict[str, list[float]] = {}
    late: list[dict[str, Any]] = []
    for i, spec in enumerate(run.specs):
        head = f"[{i + 1:>2}/{len(run.specs)} {time.monotonic() - run.t_start:5.0f}s]"
        if spec["id"] in run.skips:
            skip_row(run, spec, run.skips[spec["id"]], head)
        elif why := _over_time(run, spec, observed, runner.isolation):
            skip_row(run, spec, why, head)
            late.append(spec)
        else:
            run_row(run, runner, spec, observed, head, out)
    return late


def rerun_notes(run: Run, late: list[dict[str, Any]], out: Path) -> list[str]:
    """For the rows skipped for time: the command that runs each family, and the merge."""
    by_sel: dict[str, list[str]] = {}
    for s in late:
        by_sel.setdefault(s["selector"], [])
        if s["budget"] and s["budget"] not in by_sel[s["selector"]]:
            by_sel[s["selector"]].append(s["budget"])
    base_args = _strip_args(run.argv, ("--routes", "--budgets", "--ddo-low-ram-budgets", "--out"))
    notes = []
    for sel, buds in by_sel.items():
        extra = ["--routes", sel]
        if buds:
            extra += ["--ddo-low-ram-budgets" if sel == "ddo:low_ram_safe" else "--budgets", ",".join(buds)]
        notes.append(
            "not run for time; run it with: python -m benchmarks.run "
            + " ".join(shlex.quote(x) for x in base_args + extra)
            + f" and merge: python -m benchmarks.merge {out} <that run's folder>"
        )
    return notes


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def execute(run: Run) -> int:
    """The builder, the model in this process, the rows; SIGTERM or Ctrl-C keeps what was measured."""
    from . import model as M

    runner = Runner(run.isolation, M.new_blob(run.model.blob_bytes, run.a.cache_dir), run.a.row_timeout, run.notes)
    out: Path | None = None
    interrupted = False
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        out = run_builder(run, runner)
        if out is not None:
            load_model_here(run, runner)
            run.notes.extend(rerun_notes(run, run_rows(run, runner, out), out))
    except KeyboardInterrupt:
        interrupted = True
        runner.kill_current()
        run.notes.append("interrupted: the rows after the last one listed did not run")
        print("interrupted", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        runner.close()
    return finish(run, runner.isolation, out, interrupted)


def finish(run: Run, isolation_used: str, out: Path | None, interrupted: bool) -> int:
    """results.json, results.md and results.png, the tables printed; the exit status."""
    run.config["isolation_used"] = isolation_used
    run.doc["wall_s"] = time.monotonic() - run.t_start
    if out is None:
        return 1
    paths = R.write(run.doc, out, with_plot=not run.a.no_plot)
    print()
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for k, p in paths.items() if p.exists())} in {run.doc['wall_s']:.0f} s")
    return 130 if interrupted else 0


def merge_runs(a: argparse.Namespace) -> int:
    """``--merge DIR ...``: ``python -m benchmarks.merge``."""
    from . import merge

    return merge.main(a.merge + (["--out", a.out] if a.out else []) + (["--no-plot"] if a.no_plot else []))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.merge:
        return merge_runs(a)
    run = plan_run(a, argv)
    print_plan(run)
    if a.dry_run:
        print_estimate(run)
        return 0
    return execute(run)


def _strip_args(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    skip = False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in names:
            skip = True
            continue
        if any(x.startswith(n + "=") for n in names):
            continue
        out.append(x)
    return out


if __name__ == "__main__":
    sys.exit(main())
