"""NVMe-route benchmark: the Flux-dev-sized transformer streamed from its safetensors files at several
VRAM and RAM budgets, side by side with diffusers group offloading to disk, every row in its own
process with the page cache dropped before it.

    python -m benchmarks.nvme --device cuda --out-root "$OUT"                    # 22 GiB, GPU machine
    python -m benchmarks.nvme --device cpu --tiny --out /tmp/nvme                 # seconds, any machine

Rows: ``ours`` for every (vram_budget, ram_budget, codec) of ``--vram-budgets`` x ``--ram-budgets`` x
``--codecs`` (``off``, or a code: the disk units read from a coded side file next to the checkpoint,
written by the first row of that code, whose setup includes the coding; the side file is dropped
from the page cache before the timed calls too);
``diffusers`` (``enable_group_offload(block_level, use_stream, offload_to_disk_path=...)`` on the
model loaded by diffusers' own ``from_pretrained``) unless ``--no-diffusers``. Each row reports the
step (median of ``--repeats`` after a warm-up), the roofline ``max(compute, disk bytes / disk
bandwidth, streamed bytes / link bandwidth)`` from our report (compute: the calibrated measurement),
peak host RSS above the process's RSS before loading, the fraction of the timed calls the disk was busy
(`/proc/diskstats` of the model's block device), and exactness against the reference forward.
The model is saved once by :mod:`benchmarks.loading`'s save phase (``--dir``; reused when present).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

from benchmarks.loading import _child as _loading_child
from benchmarks.loading import _drop_cache
from benchmarks.measure import GIB as GiB
from benchmarks.measure import RssSampler, Timing, parse_size, time_forward
from benchmarks.readpipe import block_device, busy, disk_ticks


def _timed(module: Any, x: dict[str, Any], device: str, repeats: int) -> Timing:
    """One warm-up call (the first call) and ``repeats`` timed ones; the last output kept."""
    return time_forward(module, x, device, warmup=1, repeats=repeats, keep_output=True)


def row_ours(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from diffusers import FluxTransformer2DModel

    import ddo_blocks

    sampler = RssSampler().start()
    t0 = time.perf_counter()
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, args.dir, route="nvme", preset="nvme_baseline",
                                        vram_budget=args.vram, ram_budget=args.ram, device=args.device,
                                        component="transformer", progress=False, codec=args.codec)
    setup_s = time.perf_counter() - t0
    _drop_cache(Path(args.dir), "*.ddo-*.units")  # a side file just written must be read from the disk too
    _join_cgroup(args.cgroup, Path(args.dir))
    saved = torch.load(Path(args.dir) / "reference.pt")
    x = {k: (v.to(args.device) if isinstance(v, torch.Tensor) else v) for k, v in saved["inputs"].items()}
    dev = block_device(Path(args.dir))
    k0 = disk_ticks(dev)
    timing = _timed(handle.module, x, args.device, args.repeats)
    disk = busy(k0, disk_ticks(dev), timing.first_call_s + sum(timing.times))  # every call, the first included
    rss = sampler.stop()
    rep = handle.report().to_dict()
    step = timing.step_s
    result = {
        "setup_s": setup_s,
        "first_call_s": timing.first_call_s,
        "step_s": step,
        "bound_s": rep["roofline"].get("bound_s"),
        "ratio": step / rep["roofline"]["bound_s"] if rep["roofline"].get("bound_s") else None,
        "disk_gb_s": rep["roofline"].get("disk_gb_s"),
        "link_gb_s": rep["roofline"].get("link_gb_s"),
        "predicted_step_s": rep["plan"].get("predicted_step_s"),
        "calibrated_predicted_step_s": rep["runtime"].get("calibrated_predicted_step_s"),
        "rss_before": rss.start,
        "peak_rss_above_before": rss.peak - rss.start,
        "gpu_peak_allocated": rep["memory"].get("gpu_peak_allocated"),
        "exact": bool(torch.equal(timing.output[0].cpu(), saved["ref"])),
        "block_device": dev,
        **disk,
        "codec": args.codec,
        "disk_call_bytes": rep["runtime"].get("disk_call_bytes"),
        "report": {k: rep.get(k) for k in ("plan", "setup", "runtime", "roofline", "memory", "codec")},
    }
    if not args.cgroup:
        # remove() reads the disk units back into ordinary memory (its contract): the whole model, which
        # a cgroup sized to bound the page cache cannot hold, so inside one the process just exits.
        handle.remove()
    return result


def row_diffusers(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch
    from diffusers import FluxTransformer2DModel

    sampler = RssSampler().start()
    t0 = time.perf_counter()
    model = FluxTransformer2DModel.from_pretrained(args.dir, torch_dtype=torch.bfloat16)
    disk = tempfile.mkdtemp(prefix="ddo-bench-diffusers-", dir=str(Path(args.dir).parent))
    use_stream = args.device.startswith("cuda")
    model.enable_group_offload(onload_device=torch.device(args.device), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream,
                               offload_to_disk_path=disk)
    setup_s = time.perf_counter() - t0
    # the offload files were written during setup: drop them too, or they are served from the page cache
    _join_cgroup(args.cgroup, Path(args.dir), Path(disk))
    saved = torch.load(Path(args.dir) / "reference.pt")
    x = {k: (v.to(args.device) if isinstance(v, torch.Tensor) else v) for k, v in saved["inputs"].items()}
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    timing = _timed(model, x, args.device, args.repeats)
    rss = sampler.stop()
    return {
        "setup_s": setup_s,
        "first_call_s": timing.first_call_s,
        "step_s": timing.step_s,
        "rss_before": rss.start,
        "peak_rss_above_before": rss.peak - rss.start,
        "gpu_peak_allocated": torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None,
        "exact": bool(torch.equal(timing.output[0].cpu(), saved["ref"])),
    }


def row_disk(args: argparse.Namespace) -> dict[str, Any]:
    """The disk's read bandwidth, page cache bypassed with ``O_DIRECT`` (the route's own reader: 4 MiB
    positional reads): over ``--disk-probe-gib`` of the largest file with 1 and 8 readers, and over
    every file of the model in full with 8 readers (``gb_s_model``, the bound's figure: the same bytes
    a ``ram_budget=0`` row reads, so a disk that is faster on some regions, or a host cache behind a
    virtual disk, weighs in as it does for the rows)."""
    from ddo_blocks import _native

    files = sorted(Path(args.dir).glob("*.safetensors"))
    largest = max(files, key=lambda f: f.stat().st_size)
    out: dict[str, Any] = {"file": largest.name}
    for threads in (1, 8):
        _drop_cache(Path(args.dir))
        bps, nbytes, direct = _native.measure_disk_read(str(largest), int(args.disk_probe_gib * GiB), threads)
        out[f"gb_s_{threads}"] = bps / 1e9
        out["bytes"], out["direct"] = nbytes, bool(direct)
    _drop_cache(Path(args.dir))
    nbytes_all, secs = 0, 0.0
    for f in files:
        bps, nbytes, _ = _native.measure_disk_read(str(f), f.stat().st_size, 8)
        nbytes_all, secs = nbytes_all + nbytes, secs + nbytes / bps
    out["gb_s_model"], out["bytes_model"] = nbytes_all / secs / 1e9, nbytes_all
    return out


def bench_bound(row: dict[str, Any], disk_bytes_per_s: float | None) -> float | None:
    """``max(compute, disk bytes / disk bandwidth, streamed / link)`` with the disk bandwidth measured by
    the benchmark (large ``O_DIRECT`` reads) rather than the route's own 256 MiB probe."""
    report = row.get("report") or {}
    roof, plan, runtime = (report.get(k) or {} for k in ("roofline", "plan", "runtime"))
    if roof.get("compute_s") is None or not disk_bytes_per_s:
        return None
    # the bytes the last call actually read (alignment and coalescing gaps included), else the plan's
    disk = runtime.get("disk_call_bytes") or plan.get("disk_bytes") or 0
    return max(roof["compute_s"], roof.get("transfer_bound_s") or 0.0, disk / disk_bytes_per_s)


ROWS = {"ours": row_ours, "diffusers": row_diffusers, "disk": row_disk}


def make_cgroup(limit_bytes: int, name: str = "") -> Path:
    """A memory cgroup (v2, or v1's memory hierarchy) limited to ``limit_bytes``, one per row. A row
    joins it after its setup, so what it bounds is what the timed calls add: chiefly the page cache
    that would otherwise keep the model's files (or diffusers' offload files) in RAM on a large
    machine. Memory charged before joining stays charged where it was (the kernel does not move
    charges), which is why the row drops its files from the page cache right after joining."""
    root = Path("/sys/fs/cgroup")
    v2 = (root / "cgroup.controllers").is_file()
    group = (root if v2 else root / "memory") / f"ddo-bench-{os.getpid()}{name}"
    try:
        group.mkdir()
        (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit_bytes))
    except OSError as exc:
        raise SystemExit(f"--page-cache-limit needs a writable memory cgroup ({group}): {exc}; run as root "
                         "on a machine with cgroup v2's memory controller or cgroup v1's memory hierarchy, "
                         "or leave the option out") from exc
    return group


def _join_cgroup(group: str | None, *directories: Path) -> None:
    """Moves this process into ``group`` and drops the ``directories``' safetensors files from the page
    cache, so that reads from now on are charged to (and bounded by) the group."""
    if group:
        Path(group, "cgroup.procs").write_text(str(os.getpid()))
        if Path(group).name not in Path("/proc/self/cgroup").read_text():
            raise RuntimeError(f"this process did not join {group}")
        for directory in directories:
            _drop_cache(directory)


def cgroup_stats(group: Path) -> dict[str, int]:
    """What a row's cgroup saw: peak usage, times the limit was hit, OOM kills (v2 or v1 files)."""
    def read(name: str) -> str | None:
        try:
            return (group / name).read_text()
        except OSError:
            return None

    out: dict[str, int] = {}
    events = read("memory.events")
    if events is not None:  # v2
        out.update({k: int(v) for k, v in (line.split() for line in events.splitlines()) if k in ("max", "oom_kill")})
        peak = read("memory.peak")
    else:  # v1
        peak, failcnt = read("memory.max_usage_in_bytes"), read("memory.failcnt")
        if failcnt is not None:
            out["max"] = int(failcnt)
        for line in (read("memory.oom_control") or "").splitlines():
            if line.startswith("oom_kill "):
                out["oom_kill"] = int(line.split()[1])
    if peak is not None:
        out["peak_bytes"] = int(peak)
    return out


def _run_row(kind: str, argv: list[str], extra: list[str], limit_bytes: int | None = None) -> dict[str, Any]:
    """Runs one row in a child process; in a fresh memory cgroup of ``limit_bytes`` when given, whose
    peak and OOM kills join the row."""
    import signal
    import subprocess

    group = make_cgroup(limit_bytes, f"-{kind}-{time.monotonic_ns()}") if limit_bytes else None
    cmd = [sys.executable, "-X", "faulthandler", "-m", "benchmarks.nvme", "--row", kind, *argv, *extra]
    try:
        proc = subprocess.run(cmd + (["--cgroup", str(group)] if group else []), capture_output=True, text=True,
                              check=False)
    finally:
        stats = cgroup_stats(group) if group is not None else None
        if group is not None:
            _remove_cgroup(group)
    if proc.returncode != 0:
        how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exit status {proc.returncode}")
        row: dict[str, Any] = {"error": f"{how}: " + (proc.stderr or proc.stdout)[-2000:]}
    else:
        row = json.loads(proc.stdout.strip().splitlines()[-1])
    if stats is not None:
        row["cgroup"] = stats
    return row


def _remove_cgroup(group: Path) -> None:
    try:
        group.rmdir()
    except OSError as exc:
        print(f"note: could not remove {group}: {exc}", file=sys.stderr)


def _fmt(v: Any, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.nvme", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--dir", default="/tmp/ddo-loading-model", help="the saved model (made if missing)")
    p.add_argument("--vram-budgets", default="2,8", help="GiB, or fractions of the weights like 0.5x")
    p.add_argument("--ram-budgets", default="0,8,16", help="GiB, or fractions of the weights")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-diffusers", action="store_true")
    p.add_argument("--codecs", default="off", help="comma-separated: off, fixed, tiered, huffman, lossless (rows of each)")
    p.add_argument("--codec", default="off", help=argparse.SUPPRESS)
    p.add_argument("--disk-probe-gib", type=float, default=4.0, help="GiB of the largest file read by the 1- and 8-reader probes")
    p.add_argument("--page-cache-limit", type=float, default=None, metavar="GIB",
                   help="run each row's timed calls in a memory cgroup of this size (root), so that no route "
                   "is served from the page cache of a machine with more RAM than the model")
    p.add_argument("--cgroup", help=argparse.SUPPRESS)
    p.add_argument("--tokens-side", type=int, default=None)
    p.add_argument("--text-tokens", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--out-root", default="benchmarks/results")
    p.add_argument("--row", choices=sorted(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--vram", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ram", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        print(json.dumps(ROWS[args.row](args)))
        return 0
    argv = list(argv if argv is not None else sys.argv[1:])
    directory = Path(args.dir)
    if not (directory / "reference.pt").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        save_argv = ["--device", args.device, "--dir", args.dir] + (["--tiny"] if args.tiny else [])
        for flag in ("tokens_side", "text_tokens"):
            if getattr(args, flag):
                save_argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        _loading_child("save", save_argv)
    total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    base = ["--device", args.device, "--dir", args.dir, "--repeats", str(args.repeats)]
    if args.page_cache_limit:  # fail before any row where no memory cgroup can be made
        _remove_cgroup(make_cgroup(int(args.page_cache_limit * GiB), "-check"))
    return _rows_and_report(args, argv, directory, total, base)


def _rows_and_report(args: argparse.Namespace, argv: list[str], directory: Path, total: int, base: list[str]) -> int:
    limit = int(args.page_cache_limit * GiB) if args.page_cache_limit else None
    disk = _run_row("disk", base, ["--disk-probe-gib", str(args.disk_probe_gib)])
    print(f"disk before the rows: {json.dumps(disk)}", flush=True)
    rows = []
    for vram, ram, codec in itertools.product(args.vram_budgets.split(","), args.ram_budgets.split(","),
                                              args.codecs.split(",")):
        _drop_cache(directory)
        r = _run_row("ours", base, ["--vram", str(parse_size(vram, total)), "--ram", str(parse_size(ram, total)),
                                    "--codec", codec], limit)
        name = "ddo_blocks nvme_baseline" + (f" codec={codec}" if codec != "off" else "")
        rows.append({"route": name, "vram_budget": vram, "ram_budget": ram, **r})
        print(f"ours vram {vram} ram {ram} codec {codec}: step {_fmt(r.get('step_s'))} s, "
              f"ratio {_fmt(r.get('ratio'), 2)}, disk bytes/call {r.get('disk_call_bytes')}, "
              f"setup {_fmt(r.get('setup_s'), 1)} s, "
              f"disk busy {_fmt(r.get('disk_busy'), 2)}, "
              f"RSS +{_fmt((r.get('peak_rss_above_before') or 0) / GiB, 2)} GiB, exact {r.get('exact')}"
              + (f", cgroup {r['cgroup']}" if "cgroup" in r else "")
              + (f" ERROR {r['error'][-300:]}" if "error" in r else ""), flush=True)
    disk_after = _run_row("disk", base, ["--disk-probe-gib", str(args.disk_probe_gib)])
    print(f"disk after the rows: {json.dumps(disk_after)}", flush=True)
    figures = [d["gb_s_model"] for d in (disk, disk_after) if "gb_s_model" in d]
    disk_bps = sum(figures) / len(figures) * 1e9 if figures else None
    for r in rows:
        r["bench_bound_s"] = bench_bound(r, disk_bps)
        r["bench_ratio"] = r["step_s"] / r["bench_bound_s"] if r.get("bench_bound_s") and r.get("step_s") else None
        print(f"ours vram {r['vram_budget']} ram {r['ram_budget']}: step / bench bound {_fmt(r['bench_ratio'], 2)}")
    if not args.no_diffusers:
        _drop_cache(directory)
        r = _run_row("diffusers", base, [], limit)
        rows.append({"route": "diffusers group offload to disk (block_level)", "vram_budget": "-", "ram_budget": "-", **r})
        print(f"diffusers: step {_fmt(r.get('step_s'))} s, RSS +{_fmt((r.get('peak_rss_above_before') or 0) / GiB, 2)} "
              f"GiB" + (f", cgroup {r['cgroup']}" if "cgroup" in r else "")
              + (f" ERROR {r['error'][-300:]}" if "error" in r else ""), flush=True)
    doc = {"schema": "ddo_blocks.bench.nvme/1", "date": date.today().isoformat(), "machine": platform.node(),
           "command": "python -m benchmarks.nvme " + " ".join(argv), "weights_bytes": total, "disk": disk,
           "disk_after": disk_after, "bench_disk_gb_s": disk_bps / 1e9 if disk_bps else None,
           "page_cache_limit_gib": args.page_cache_limit,
           "rows": rows}
    out = Path(args.out) if args.out else Path(args.out_root) / f"{date.today().isoformat()}-{platform.node()}-nvme"
    out.mkdir(parents=True, exist_ok=True)
    (out / "nvme.json").write_text(json.dumps(doc, indent=2))
    lines = [
        f"# NVMe route, {doc['date']}", "", f"Command: `{doc['command']}`; weights {total / GiB:.2f} GiB.", "",
        f"Disk, page cache bypassed (O_DIRECT {disk.get('direct')}, the route's reader): "
        f"{(disk.get('bytes') or 0) / GiB:.1f} GiB of {disk.get('file')}: {_fmt(disk.get('gb_s_1'), 2)} GB/s with 1 "
        f"reader, {_fmt(disk.get('gb_s_8'), 2)} GB/s with 8; every file in full "
        f"({(disk.get('bytes_model') or 0) / GiB:.1f} GiB) with 8 readers: {_fmt(disk.get('gb_s_model'), 2)} GB/s "
        f"before the rows, {_fmt(disk_after.get('gb_s_model'), 2)} GB/s after them. `bench bound s` uses the mean "
        "of those two whole-model figures; `bound s` the route's own 256 MiB probe at attach (`disk GB/s`).", "",
        *([f"Timed calls ran in a memory cgroup of {args.page_cache_limit:g} GiB per row (joined after setup, the "
           "files dropped from the page cache on joining): page cache beyond it is reclaimed, so no route is "
           "served from RAM it was not given.", ""]
          if args.page_cache_limit else []),
        "| route | VRAM budget | RAM budget | step s | bound s | step / bound | bench bound s | step / bench bound "
        "| disk GB/s | disk GB per call | disk busy | RSS above start GiB | peak GPU GiB | setup s | exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gpu = r.get("gpu_peak_allocated")
        lines.append(
            f"| {r['route']} | {r['vram_budget']} | {r['ram_budget']} | {_fmt(r.get('step_s'))} | {_fmt(r.get('bound_s'))} "
            f"| {_fmt(r.get('ratio'), 2)} | {_fmt(r.get('bench_bound_s'))} | {_fmt(r.get('bench_ratio'), 2)} "
            f"| {_fmt(r.get('disk_gb_s'), 2)} | {_fmt((r.get('disk_call_bytes') or 0) / 1e9, 2)} "
            f"| {_fmt(r.get('disk_busy'), 2)} "
            f"| {_fmt((r.get('peak_rss_above_before') or 0) / GiB, 2)} | {_fmt(gpu / GiB if gpu else None, 2)} "
            f"| {_fmt(r.get('setup_s'), 1)} | {r.get('exact', r.get('error', '-')[:60])} |"
        )
    if args.page_cache_limit:
        lines += ["", "Each row's cgroup (timed calls only): peak usage, times the limit was reached, OOM kills.", "",
                  "| route | VRAM budget | RAM budget | cgroup peak GiB | limit reached | OOM kills |", "|---|---|---|---|---|---|"]
        for r in rows:
            cg = r.get("cgroup") or {}
            peak = cg.get("peak_bytes")
            lines.append(f"| {r['route']} | {r['vram_budget']} | {r['ram_budget']} | "
                         f"{_fmt(peak / GiB if peak is not None else None, 2)} | {cg.get('max', '-')} | {cg.get('oom_kill', '-')} |")
    (out / "nvme.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}/nvme.json and nvme.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
