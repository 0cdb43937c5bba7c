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
from pathlib import Path
from typing import Any

from . import ROOT
from . import results as R
from .isolation import Runner, choose_isolation, import_diffusers
from .rows import expand_routes, make_specs, parse_budget

GIB = 1 << 30
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
        "that route at its own budgets instead of --budgets (ours:one_shot_fast@7/16)",
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
# the run
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.merge:
        from . import merge

        return merge.main(
            a.merge + (["--out", a.out] if a.out else []) + (["--no-plot"] if a.no_plot else [])
        )
    t_start = time.monotonic()
    now = datetime.datetime.now(datetime.UTC)
    command = "python -m benchmarks.run " + " ".join(shlex.quote(x) for x in argv)
    cuda = a.device.startswith("cuda")
    resolution = a.resolution or (128 if a.tiny else 1024)
    side = max(1, resolution // 16)
    text_tokens = a.text_tokens or (16 if a.tiny else 512)
    time_limit = a.time_limit if a.time_limit is not None else (480.0 if cuda else 0.0)

    import torch

    from . import model as M
    from .worker import stub_row

    import_diffusers(cuda)
    cfg = model_config(a)
    dtype = M.dtype_of(a.dtype)
    meta = M.skeleton(cfg, dtype)
    entries, blob_bytes = M.layout(meta)
    wbytes = M.weight_bytes(meta)
    minimum = None
    try:
        from ddo_blocks import _native
        from ddo_blocks.units import split_units, tensor_nbytes

        units, left = split_units(meta)
        base = sum(tensor_nbytes(p) for _, p in left) + sum(tensor_nbytes(b) for b in meta.buffers())
        minimum = _native.minimum_budget(
            [_native.layout_unit([tensor_nbytes(p) for _, p in u.params])[1] for u in units], base
        )
    except Exception as exc:  # noqa: BLE001
        print(f"note: ddo_blocks is not importable here ({exc}); budget 'min' unavailable", file=sys.stderr)
    del meta
    budgets = [
        parse_budget(t, wbytes, minimum)
        for t in (a.budgets or ("min,0.85x" if a.tiny else "2,4,8,12,16")).split(",")
    ]
    ddo_low = [
        parse_budget(t, wbytes, minimum)
        for t in (a.ddo_low_ram_budgets or ("0.85x" if a.tiny else "4")).split(",")
    ]
    selectors = expand_routes(a.routes)
    specs = make_specs(selectors, budgets, ddo_low, lambda t: parse_budget(t, wbytes, minimum))

    versions = _versions()
    notes: list[str] = []
    predetermined: dict[str, str] = {}
    for s in specs:
        if s["route"] == "ddo":
            if not cuda:
                predetermined[s["id"]] = "DDO 0.1.0rc2 needs a CUDA device: skipped on the CPU"
            elif (
                versions.get("ddo_rc2") is None
                and importlib.util.find_spec("diffusers_dynamic_offloader") is None
            ):
                predetermined[s["id"]] = (
                    "diffusers-dynamic-offloader (the original DDO) is not installed: skipped"
                )
    notes.extend(sorted(set(predetermined.values())))

    scale = max(0.02, wbytes / FLUX_DEV_BYTES)

    def estimate(sel: str, observed: dict[str, list[float]], isolation: str) -> float:
        if observed.get(sel):
            return 1.1 * sum(observed[sel]) / len(observed[sel])
        base = EST_GPU_S.get(sel, EST_GPU_S.get(sel.split(":")[0], 20))
        est = 1.0 + base * scale
        if isolation == "spawn":
            est += 6 + 6 * scale
        return est if cuda else 0.5 + est * 0.1

    isolation, why = choose_isolation(a.isolation)
    if why:
        notes.append(why)

    ctx = {
        "device": a.device,
        "cfg": cfg,
        "dtype": a.dtype,
        "seed": a.seed,
        "height_tokens": side,
        "width_tokens": side,
        "text_tokens": text_tokens,
        "repeats": a.repeats,
        "warmup": max(1, a.warmup),
        "weight_bytes": wbytes,
        "bw_bytes": parse_budget(a.bw_bytes, wbytes, None)[1] if a.bw_bytes else (GIB if cuda else 64 << 20),
        "bw_threads": [int(x) for x in a.bw_threads.split(",") if x.strip()],
        "bandwidth": not a.no_bandwidth,
        "load_threads": a.load_threads,
        "rss_interval_s": 0.01,
    }
    desc = (
        f"FluxTransformer2DModel {cfg['num_layers']}+{cfg['num_single_layers']} blocks, "
        f"width {cfg['num_attention_heads'] * cfg['attention_head_dim']} "
        f"({cfg['num_attention_heads']}x{cfg['attention_head_dim']})" + (" [tiny]" if a.tiny else "")
    )
    config = {
        "device": a.device,
        "tiny": a.tiny,
        "dtype": a.dtype,
        "resolution": resolution,
        "image_tokens": side * side,
        "text_tokens": text_tokens,
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
            "description": desc,
            "cfg": cfg,
            "weight_bytes": wbytes,
            "blob_bytes": blob_bytes,
            "double_layers": cfg["num_layers"],
            "single_layers": cfg["num_single_layers"],
            "width": cfg["num_attention_heads"] * cfg["attention_head_dim"],
        },
    }

    print(
        f"benchmark: {desc}, {wbytes / GIB:.2f} GiB {a.dtype}; {side * side}+{text_tokens} tokens; "
        f"{len(specs)} rows on {a.device}; isolation {isolation}"
        + (f"; time limit {time_limit:.0f} s" if time_limit else ""),
        flush=True,
    )
    if a.dry_run:
        total = estimate("build", {}, isolation) + (3 * scale if isolation == "fork" else 0)
        for s in specs:
            e = 0 if s["id"] in predetermined else estimate(s["selector"], {}, isolation)
            total += e
            print(
                f"  {s['id']:<40} ~{e:5.0f} s"
                + (f"  ({predetermined[s['id']]})" if s["id"] in predetermined else "")
            )
        print(f"estimated total: {total:.0f} s")
        return 0

    machine: dict[str, Any] = {k: v for k, v in versions.items()}
    import platform

    import psutil

    machine.update(
        hostname=platform.node(),
        cpu_count=os.cpu_count(),
        ram_bytes=psutil.virtual_memory().total,
        python=platform.python_version(),
        torch=torch.__version__,
    )
    doc: dict[str, Any] = {
        "schema": R.SCHEMA,
        "created": now.isoformat(timespec="seconds"),
        "command": command,
        "machine": machine,
        "config": config,
        "bandwidth": None,
        "rows": [],
        "notes": notes,
    }

    fd = M.new_blob(blob_bytes, a.cache_dir)
    runner = Runner(isolation, fd, a.row_timeout, notes)
    out: Path | None = None
    interrupted = False

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        # 1. the builder: weights into the blob, machine facts, bandwidth
        build_job = {"kind": "build", "ctx": ctx, "entries": entries}
        t0 = time.monotonic()
        res = runner.run_job(build_job, timeout=max(a.row_timeout, 300))
        if res.get("status") == "error":
            print(
                f"error: building the model failed: {res.get('error')}\n{res.get('traceback', '')}",
                file=sys.stderr,
            )
            notes.append(f"building the model failed: {res.get('error')}")
            doc["build_error"] = {k: res.get(k) for k in ("error", "traceback")}
            out = _out_dir(a, machine, now)
            R.write(doc, out, with_plot=False)
            print(f"wrote {out / 'results.json'}", file=sys.stderr)
            return 1
        machine.update({k: v for k, v in res.get("machine", {}).items() if v is not None or k not in machine})
        doc["bandwidth"] = res.get("bandwidth")
        doc["build"] = {"build_s": res.get("build_s"), "process_s": time.monotonic() - t0}
        out = _out_dir(a, machine, now)
        out.mkdir(parents=True, exist_ok=True)
        bw = doc["bandwidth"] or {}
        print(
            f"built {wbytes / GIB:.2f} GiB of weights in {res.get('build_s', 0):.1f} s "
            f"({time.monotonic() - t0:.1f} s with the process); "
            + (
                f"pinned h2d {bw.get('pinned_h2d_gb_s', 0):.1f} GB/s, pageable {bw.get('pageable_h2d_gb_s', 0):.1f} GB/s, "
                f"host copy {bw.get('host_copy_gb_s')}; "
                if bw
                else ""
            )
            + f"results -> {out}",
            flush=True,
        )

        # 2. the model, once, in this process (fork isolation)
        if runner.isolation == "fork":
            t0 = time.monotonic()
            runner.model = M.load_model(cfg, dtype, entries, fd, a.load_threads)
            doc["build"]["parent_load_s"] = time.monotonic() - t0
            print(f"loaded the model into this process in {time.monotonic() - t0:.1f} s", flush=True)

        # 3. the rows
        observed: dict[str, list[float]] = {}
        skipped_for_time: list[dict[str, Any]] = []
        for i, spec in enumerate(specs):
            head = f"[{i + 1:>2}/{len(specs)} {time.monotonic() - t_start:5.0f}s]"
            if spec["id"] in predetermined:
                row = stub_row(spec, "skipped", predetermined[spec["id"]])
                doc["rows"].append(row)
                print(f"{head} {_fmt_row(row)}", flush=True)
                continue
            est = estimate(spec["selector"], observed, runner.isolation)
            elapsed = time.monotonic() - t_start
            if time_limit and elapsed + est > time_limit:
                row = stub_row(
                    spec,
                    "skipped",
                    f"time limit: {elapsed:.0f} s gone, this row needs about "
                    f"{est:.0f} s of the {time_limit:.0f} s",
                )
                doc["rows"].append(row)
                skipped_for_time.append(spec)
                print(f"{head} {_fmt_row(row)}", flush=True)
                continue
            job = {"kind": "row", "ctx": ctx, "spec": spec, "entries": entries}
            res = runner.run_job(job)
            if cuda and res.get("status") == "ok":
                runner.forked_cuda_works()
            res["selector"] = spec["selector"]
            observed.setdefault(spec["selector"], []).append(res.get("process_wall_s", 0.0))
            doc["rows"].append(res)
            print(f"{head} {_fmt_row(res)} ({res.get('process_wall_s', 0):.1f} s)", flush=True)
            if res.get("status") == "error" and res.get("traceback"):
                print(res["traceback"], file=sys.stderr, flush=True)
            config["isolation_used"] = runner.isolation
            R.write(doc, out, with_plot=False)
        if skipped_for_time:
            by_sel: dict[str, list[str]] = {}
            for s in skipped_for_time:
                by_sel.setdefault(s["selector"], [])
                if s["budget"] and s["budget"] not in by_sel[s["selector"]]:
                    by_sel[s["selector"]].append(s["budget"])
            base_args = [
                x for x in _strip_args(argv, ("--routes", "--budgets", "--ddo-low-ram-budgets", "--out"))
            ]
            for sel, buds in by_sel.items():
                extra = ["--routes", sel]
                if buds:
                    extra += [
                        "--ddo-low-ram-budgets" if sel == "ddo:low_ram_safe" else "--budgets",
                        ",".join(buds),
                    ]
                notes.append(
                    "not run for time; run it with: python -m benchmarks.run "
                    + " ".join(shlex.quote(x) for x in base_args + extra)
                    + f" and merge: python -m benchmarks.merge {out} <that run's folder>"
                )
    except KeyboardInterrupt:
        interrupted = True
        runner.kill_current()
        notes.append("interrupted: the rows after the last one listed did not run")
        print("interrupted", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        runner.close()
    config["isolation_used"] = runner.isolation
    doc["wall_s"] = time.monotonic() - t_start
    if out is None:
        return 1
    paths = R.write(doc, out, with_plot=not a.no_plot)
    print()
    print(paths["md"].read_text())
    print(f"wrote {', '.join(str(p) for k, p in paths.items() if p.exists())} in {doc['wall_s']:.0f} s")
    return 130 if interrupted else 0


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
