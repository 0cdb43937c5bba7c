"""What runs inside one isolated process: the builder (weights, machine facts, bandwidth) or one
benchmark row (one route, preset and budget).

In ``fork`` isolation the orchestrator calls :func:`run_job` in a forked child that already holds the
loaded model; in ``spawn`` isolation ``python -m benchmarks.worker JOB.json`` runs it in a fresh
interpreter that loads the model from the weight blob itself (its descriptor is passed down).
Either way the result is written as JSON to the job's ``result_path`` and the process ends with
``os._exit``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .isolation import is_fork_cuda_failure
from .measure import GIB, RssSampler, sync, time_forward

ROW_FIELDS = (
    "id",
    "route",
    "preset",
    "budget",
    "budget_bytes",
    "offload_type",
    "codec",
    "status",
    "error",
    "note",
    "step_s",
    "step_s_all",
    "first_call_s",
    "setup_s",
    "gpu_peak_allocated",
    "gpu_peak_reserved",
    "gpu_setup_peak_allocated",
    "gpu_after_attach",
    "host_peak_rss",
    "host_rss_start",
    "pinned_bytes",
    "pinned_source",
    "torch_pinned_peak_bytes",
    "streamed_bytes",
    "streamed_bytes_source",
    "predicted_step_s",
)
"""Every row has these keys (``None`` where not measured or not applicable)."""


def stub_row(spec: dict[str, Any], status: str = "error", note: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_FIELDS)
    row.update({k: spec.get(k) for k in ("id", "route", "preset", "budget", "budget_bytes", "offload_type", "codec",
                                         "replan", "graph")})
    row.update(status=status, note=note)
    return row


# -------------------------------------------------------------------------------------------------
# helpers
# -------------------------------------------------------------------------------------------------
def device_of(name: str):
    """``torch.device`` with an explicit index for CUDA (``torch.cuda.set_device`` needs one)."""
    import torch

    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    return dev


def _torch_pinned_peak() -> int | None:
    import torch

    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - absent or unsupported in this torch
        return None
    for key in ("allocated_bytes.peak", "allocated_bytes.all.peak", "reserved_bytes.peak"):
        if key in stats:
            return int(stats[key])
    return None


def _jsonable(x: Any, limit: int = 20000) -> Any:
    try:
        text = json.dumps(x, default=str)
    except (TypeError, ValueError):
        text = json.dumps(str(x))
    if len(text) > limit:
        return {"truncated": text[:limit]}
    return json.loads(text)


# -------------------------------------------------------------------------------------------------
# the builder: weights, machine facts, bandwidth
# -------------------------------------------------------------------------------------------------
def machine_facts(dev) -> dict[str, Any]:
    import psutil
    import torch

    facts: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        facts.update(
            gpu_name=props.name,
            gpu_memory_bytes=props.total_memory,
            gpu_capability=f"{props.major}.{props.minor}",
        )
        driver = None
        try:
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,pcie.link.gen.max,pcie.link.width.max",
                    "--format=csv,noheader",
                    f"--id={dev.index or 0}",
                ],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
            if out.returncode == 0 and out.stdout.strip():
                parts = [s.strip() for s in out.stdout.strip().splitlines()[0].split(",")]
                driver = parts[0]
                if len(parts) >= 3:
                    facts["pcie"] = f"Gen{parts[1]} x{parts[2]}"
        except (OSError, subprocess.SubprocessError):
            pass
        if driver is None:
            try:
                from ddo_blocks import _native

                driver = f"CUDA driver API {_native.cuda_driver_version()}"
            except Exception:  # noqa: BLE001
                driver = None
        facts["driver"] = driver
    else:
        facts.update(gpu_name=None, driver=None)
    return facts


def _memmove_threads(dst: int, src: int, nbytes: int, threads: int) -> float:
    chunk = (nbytes + threads - 1) // threads
    workers = []
    for i in range(threads):
        off = i * chunk
        n = min(chunk, nbytes - off)
        if n > 0:
            workers.append(threading.Thread(target=ctypes.memmove, args=(dst + off, src + off, n)))
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def measure_bandwidth(dev, nbytes: int, threads: list[int], reps: int = 5) -> dict[str, Any]:
    """Host->device copies of ``nbytes`` from pinned and from pageable memory, and multi-threaded
    pageable->pinned host copies (``ctypes.memmove`` in N threads, the staging path of low_ram_safe).
    Decimal GB/s, median of ``reps``. On the CPU the 'link' is a memcpy between two buffers."""
    import torch

    res: dict[str, Any] = {"bytes": nbytes, "reps": reps}
    cuda = dev.type == "cuda"
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pinned.fill_(2)
    if cuda:
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        stream = torch.cuda.current_stream(dev)
        gpu.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            gpu.copy_(pinned, non_blocking=True)
            b.record(stream)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        res["pinned_h2d_gb_s"] = nbytes / statistics.median(times) / 1e9
        gpu.copy_(pageable)
        torch.cuda.synchronize(dev)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            gpu.copy_(pageable)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        res["pageable_h2d_gb_s"] = nbytes / statistics.median(times) / 1e9
        res["link"] = "host->device over the GPU link (1 copy of the whole buffer per rep)"
        del gpu
    else:
        other = torch.empty(nbytes, dtype=torch.uint8)
        other.fill_(3)
        _memmove_threads(other.data_ptr(), pageable.data_ptr(), nbytes, 1)
        times = [_memmove_threads(other.data_ptr(), pageable.data_ptr(), nbytes, 1) for _ in range(reps)]
        bw = nbytes / statistics.median(times) / 1e9
        res["pinned_h2d_gb_s"] = bw
        res["pageable_h2d_gb_s"] = bw
        res["link"] = "cpu: single-thread memcpy (no GPU link)"
        del other
    host: dict[str, float] = {}
    for n in threads:
        _memmove_threads(pinned.data_ptr(), pageable.data_ptr(), nbytes, n)
        times = [
            _memmove_threads(pinned.data_ptr(), pageable.data_ptr(), nbytes, n)
            for _ in range(max(3, reps // 2))
        ]
        host[str(n)] = nbytes / statistics.median(times) / 1e9
    res["host_copy_gb_s"] = host
    del pinned, pageable
    return res


def run_build(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from . import model as M

    ctx = job["ctx"]
    dev = device_of(ctx["device"])
    if dev.type == "cuda":
        torch.cuda.init()
        torch.cuda.set_device(dev)
    out: dict[str, Any] = {"kind": "build"}
    out["machine"] = machine_facts(dev)
    out["build_s"] = M.fill_blob(
        ctx["cfg"], M.dtype_of(ctx["dtype"]), job["entries"], job["blob_fd"], dev, ctx["seed"]
    )
    if ctx.get("bandwidth", True):
        t0 = time.perf_counter()
        out["bandwidth"] = measure_bandwidth(dev, ctx["bw_bytes"], ctx["bw_threads"])
        out["bandwidth"]["seconds"] = time.perf_counter() - t0
    return out


# -------------------------------------------------------------------------------------------------
# one row
# -------------------------------------------------------------------------------------------------
class Attached:
    """What a route's attach returns: the module to call and route facts for the row."""

    def __init__(
        self, module, info: dict[str, Any] | None = None, after: Callable[[], dict[str, Any]] | None = None
    ):
        self.module = module
        self.info = info or {}
        self.after = after


def _attach_resident(model, spec, dev, ctx) -> Attached:
    import torch

    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        need = int(ctx["weight_bytes"] * 1.1) + 4 * GIB
        if need > free:
            raise _Skip(
                f"the GPU has {free / GIB:.1f} GiB free; all weights resident need about {need / GIB:.1f} GiB"
            )
    model.to(dev)
    return Attached(
        model,
        {
            "streamed_bytes": 0,
            "streamed_bytes_source": "none (every weight resident)",
            "pinned_bytes": 0,
            "pinned_source": "none",
        },
    )


def _offload_ours(model, spec, dev):
    import torch

    import ddo_blocks
    from ddo_blocks.streaming import coded

    codec = spec.get("codec", "off")
    options: dict[str, Any] = {"codec": codec} if codec != "off" else {}
    if spec.get("graph"):
        options["graph"] = True
    budget = spec["budget_bytes"]
    if spec.get("budget") == "min" and codec != "off":
        # the same plan as the uncompressed row at 'min', plus the codec's landing buffers
        budget += coded.reserve_bytes(model, codec, torch.device(dev))
    return ddo_blocks.offload(
        model,
        route=spec["ddo_blocks_route"],
        preset=spec["preset"],
        vram_budget=budget,
        device=dev,
        component="transformer",
        **options,
    )


def _attach_ours(model, spec, dev, ctx) -> Attached:
    handle = _offload_ours(model, spec, dev)
    rep = handle.report().to_dict()
    info = {
        "streamed_bytes": rep["plan"].get("streamed_bytes"),
        "streamed_bytes_source": "ddo_blocks report plan.streamed_bytes",
        "predicted_step_s": rep["plan"].get("predicted_step_s"),
        "preset_resolved": rep.get("preset"),
        "staging_threads": getattr(handle.preset, "staging_threads", None),
        "graph": bool(spec.get("graph")),
    }
    state = {"handle": handle}

    def after() -> dict[str, Any]:
        r = state["handle"].report().to_dict()
        extra = {
            "pinned_bytes": r["memory"].get("pinned_bytes"),
            "pinned_source": "ddo_blocks report memory.pinned_bytes",
            "predicted_step_s": r["plan"].get("predicted_step_s"),
            "report": {k: r.get(k) for k in ("preset", "plan", "setup", "runtime", "roofline", "memory", "codec",
                                             "graph")},
        }
        return extra

    info["_state"] = state
    return Attached(model, info, after)


def _attach_diffusers(model, spec, dev, ctx) -> Attached:
    import torch

    kind = spec["offload_type"]
    kwargs: dict[str, Any] = {
        "onload_device": dev,
        "offload_device": torch.device("cpu"),
        "offload_type": kind,
        "use_stream": dev.type == "cuda",
    }
    if kind == "block_level":
        kwargs["num_blocks_per_group"] = 1
    model.enable_group_offload(**kwargs)
    call = f"model.enable_group_offload({', '.join(f'{k}={v!s}' for k, v in kwargs.items())})"
    return Attached(model, {"call": call, "use_stream": kwargs["use_stream"]})


def _attach_ddo(model, spec, dev, ctx) -> Attached:
    if importlib.util.find_spec("diffusers_dynamic_offloader") is None:
        raise _Skip("diffusers_dynamic_offloader (the original DDO) is not installed")
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    import diffusers_dynamic_offloader as ddo

    fn = getattr(ddo, "enable_offload", None)
    if fn is None:
        raise RuntimeError("diffusers_dynamic_offloader has no enable_offload()")
    kwargs: dict[str, Any] = {"preset": spec["preset"], "component": "transformer"}
    if spec.get("route"):
        kwargs["route"] = spec["route"]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "execution_device" in params:
        kwargs["execution_device"] = f"cuda:{dev.index or 0}" if dev.type == "cuda" else str(dev)
    result = fn(model, **kwargs)
    module = getattr(result, "module", None)
    if module is None:
        module = model
    info: dict[str, Any] = {
        "ddo_route": getattr(result, "route", None),
        "call": f"enable_offload(model, {kwargs})",
    }
    if getattr(result, "should_move_to_execution_device", False):
        info["note"] = "DDO asked the caller to move the module to the device (no offload applied); moved it"
        module.to(dev)
    hook = getattr(result, "hook", None)
    st = getattr(hook, "state", None)
    if st is not None:
        info["ddo_state"] = _jsonable(
            {
                "bytes_by_placement": getattr(st, "bytes_by_placement", None),
                "planner_decisions": getattr(st, "planner_decisions", None),
                "setup_seconds_by_action": getattr(st, "setup_seconds_by_action", None),
                "selected_resident_modules": len(getattr(st, "selected_resident_modules", []) or []),
            }
        )
    payload = getattr(result, "event_payload", None)
    if payload:
        info["ddo_event_payload"] = _jsonable(payload, limit=4000)
    return Attached(module, info)


class _Skip(Exception):
    pass


ATTACH = {
    "resident": _attach_resident,
    "ours": _attach_ours,
    "diffusers": _attach_diffusers,
    "ddo": _attach_ddo,
}


def _process_warmup(model, dev, dtype, ctx: dict[str, Any]) -> float:
    """One forward of a 1 + 1 block model of the same width and input shapes, before anything is
    attached: CUDA context, cuBLAS handles and the kernels of these shapes get loaded here, so a row's
    ``first_call_s`` measures the route's own first call (order tracing, cold slots), not the process's."""
    import torch

    t = time.perf_counter()
    cfg = {**dict(model.config), "num_layers": 1, "num_single_layers": 1}
    with torch.device("meta"):
        small = type(model).from_config(cfg)
    small = small.to_empty(device=dev).to(dtype)
    with torch.no_grad():
        for p in small.parameters():
            p.normal_(0, 0.02)
        inputs = _row_inputs(small, dev, dtype, ctx)
        small(**inputs)
    sync(dev)
    del small, inputs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    return time.perf_counter() - t


PEERS = ("diffusers", "ddo")
"""Routes whose streamed and pinned bytes are estimated from torch's counters (no report)."""


def _start_device(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.init()
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def _attach(model, spec, dev, ctx, row: dict[str, Any]) -> Attached:
    """Attaches the row's route (``setup_s``) and records its facts and the GPU memory after it."""
    import torch

    t0 = time.perf_counter()
    attached = ATTACH[spec["route"]](model, spec, dev, ctx)
    sync(dev)
    row["setup_s"] = time.perf_counter() - t0
    row.update({k: v for k, v in attached.info.items() if k != "_state"})
    if dev.type == "cuda":
        row["gpu_after_attach"] = torch.cuda.memory_allocated(dev)
        if spec["route"] in PEERS and row.get("streamed_bytes") is None:
            row["streamed_bytes"] = max(0, ctx["weight_bytes"] - row["gpu_after_attach"])
            row["streamed_bytes_source"] = (
                "estimate: weight bytes minus GPU memory allocated after attach (before any call)"
            )
    elif row.get("streamed_bytes") is None:
        row["streamed_bytes"] = ctx["weight_bytes"]
        row["streamed_bytes_source"] = "cpu: every weight bytes (no device link)"
    return attached


def _row_inputs(module, dev, dtype, ctx) -> dict[str, Any]:
    from . import model as M

    return M.make_inputs(module, height_tokens=ctx["height_tokens"], width_tokens=ctx["width_tokens"],
                         text_tokens=ctx["text_tokens"], device=dev, dtype=dtype, seed=ctx["seed"] + 1)


def _setup_peak(dev, row: dict[str, Any]) -> Callable[[], None]:
    """After the warm-up: the setup's peak GPU memory, then the counters reset for the timed calls."""
    import torch

    def record() -> None:
        if dev.type == "cuda":
            row["gpu_setup_peak_allocated"] = torch.cuda.max_memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)

    return record


def _step(attached: Attached, inputs, dev, ctx, row: dict[str, Any]) -> None:
    """The first call, the warm-up and the timed calls: ``first_call_s`` and the step."""
    warmup = ctx["warmup"]
    if attached.info.get("graph"):  # the eager calls before the first capture, then one capture per slot state
        from ddo_blocks.streaming.graph import WARMUP_CALLS

        slots = attached.info["_state"]["handle"].report()["plan"]["slots"]
        warmup = max(warmup, WARMUP_CALLS + max(1, slots))
    timing = time_forward(attached.module, inputs, dev, warmup=warmup, repeats=ctx["repeats"],
                          after_warmup=_setup_peak(dev, row))
    row["warmup_calls"] = warmup
    row["host_call_s"] = statistics.median(timing.host_times) if timing.host_times else None
    row["first_call_s"] = timing.first_call_s
    row["step_s"] = timing.step_s
    row["step_s_all"] = timing.times
    row["step_s_min"] = min(timing.times)


def _replan(attached: Attached, inputs, dev, row: dict[str, Any]) -> None:
    """Two calls (the second measures each unit's compute), then ``handle.replan()``: whether the
    plan changed, what it cost, and the measured plan's predicted gain."""
    import torch

    handle = attached.info["_state"]["handle"]
    with torch.no_grad():
        for _ in range(2):
            attached.module(**inputs)
    sync(dev)
    row["replan_predicted_gain"] = handle.report()["plan"].get("measured_plan_gain")
    t0 = time.perf_counter()
    row["replanned"] = handle.replan()
    sync(dev)
    row["replan_s"] = time.perf_counter() - t0


def _memory_after(attached: Attached, spec, dev, row: dict[str, Any]) -> None:
    """Peak GPU memory of the timed calls, the route's own facts after them, and the peers' pinned bytes."""
    import torch

    if dev.type == "cuda":
        row["gpu_peak_allocated"] = torch.cuda.max_memory_allocated(dev)
        row["gpu_peak_reserved"] = torch.cuda.max_memory_reserved(dev)
        row["torch_pinned_peak_bytes"] = _torch_pinned_peak()
    else:
        row["gpu_peak_allocated"] = row["gpu_peak_reserved"] = None
    if attached.after is not None:
        row.update(attached.after())
    if spec["route"] in PEERS and row.get("pinned_bytes") is None:
        row["pinned_bytes"] = row.get("torch_pinned_peak_bytes")
        row["pinned_source"] = (
            "torch pinned-allocator peak (power-of-two rounded)" if row["pinned_bytes"] is not None else "not measured"
        )


def _measure_row(job: dict[str, Any], model, row: dict[str, Any]) -> None:
    from . import model as M

    spec, ctx = job["spec"], job["ctx"]
    dev = device_of(ctx["device"])
    dtype = M.dtype_of(ctx["dtype"])
    _start_device(dev)
    if ctx.get("process_warmup", True):
        row["process_warmup_s"] = _process_warmup(model, dev, dtype, ctx)
    attached = _attach(model, spec, dev, ctx, row)
    inputs = _row_inputs(attached.module, dev, dtype, ctx)
    if spec.get("replan"):
        _replan(attached, inputs, dev, row)
    _step(attached, inputs, dev, ctx, row)
    _memory_after(attached, spec, dev, row)
    if spec.get("keep_warm") and ctx.get("warm_rerun", True):
        row.update(_warm_rerun(attached, spec, dev, inputs, ctx))


def run_row(job: dict[str, Any], model) -> dict[str, Any]:
    """One row: attach, warm up, time; an error or a skip is the row's status. Peak host RSS over all of it."""
    sampler = RssSampler(job["ctx"].get("rss_interval_s", 0.01)).start()
    row = stub_row(job["spec"])
    row.update(pid=os.getpid(), host_rss_start=sampler.start_rss)
    try:
        _measure_row(job, model, row)
        row["status"] = "ok"
    except _Skip as exc:
        row["status"] = "skipped"
        row["note"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded as the row's error
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]
        if is_fork_cuda_failure(row["error"]) and job.get("isolation") == "fork":
            row["fork_cuda_failure"] = True
    rss = sampler.stop()
    row.update(host_rss_end=rss.end, host_peak_rss_sampled=rss.sampled, host_ru_maxrss=rss.ru_maxrss,
               host_peak_rss=rss.peak)
    return row


def _warm_rerun(attached: Attached, spec, dev, inputs, ctx) -> dict[str, Any]:
    """keep_warm (warm_process): remove() and offload the same weights again; the slabs should be
    reused without copying or pinning. Records the second setup, its first call and a short median."""
    handle = attached.info["_state"]["handle"]
    model = attached.module
    handle.remove()
    t0 = time.perf_counter()
    h2 = _offload_ours(model, spec, dev)
    sync(dev)
    res: dict[str, Any] = {"warm_setup_s": time.perf_counter() - t0}
    rep = h2.report().to_dict()
    res["warm_reused"] = rep["setup"].get("warm_reused")
    timing = time_forward(model, inputs, dev, warmup=1, repeats=max(1, ctx.get("warm_repeats", 2)))
    res["warm_first_call_s"] = timing.first_call_s
    res["warm_step_s"] = timing.step_s
    return res


# -------------------------------------------------------------------------------------------------
# entry points
# -------------------------------------------------------------------------------------------------
def run_job(job: dict[str, Any], model=None) -> dict[str, Any]:
    """Runs a job in this process and writes its result JSON. Never raises."""
    t0 = time.perf_counter()
    try:
        if job["kind"] == "build":
            res = run_build(job)
        else:
            if model is None:
                from . import model as M

                ctx = job["ctx"]
                model = M.load_model(
                    ctx["cfg"],
                    M.dtype_of(ctx["dtype"]),
                    job["entries"],
                    job["blob_fd"],
                    ctx.get("load_threads", 8),
                )
            res = run_row(job, model)
    except BaseException as exc:  # noqa: BLE001 - the parent reads the error
        res = {
            "kind": job["kind"],
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
        if is_fork_cuda_failure(res["error"]) and job.get("isolation") == "fork":
            res["fork_cuda_failure"] = True
        if "spec" in job:
            res = {**stub_row(job["spec"]), **res}
    res["child_wall_s"] = time.perf_counter() - t0
    res["isolation"] = job.get("isolation")
    tmp = job["result_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=str)
    os.replace(tmp, job["result_path"])
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job = json.load(f)
    for k, v in job.get("env", {}).items():
        os.environ[k] = str(v)
    run_job(job)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
