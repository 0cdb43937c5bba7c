"""Where the host time of a replayed call goes (``graph=True``): a Flux-structured transformer of
tiny width (ddo_blocks.tiny's config with 19 + 38 blocks, the module and parameter counts of Flux-dev, so the host's work per
call is Flux's while the device's is small), offloaded on the GPU with graphs on, timed call by call
after each synchronize, then profiled with ``cProfile`` over the same calls:

    python -m benchmarks.graph_host --budget min --out "$OUT/graph-host"
    python -m benchmarks.graph_host --budget min --device-launch-copies   # the streamed graph launched for the device
    python -m benchmarks.graph_host --full --budget 16 --calls 10 [--device-launch-copies]   # full width, 512x512

Prints and writes (``graph_host.json``, ``graph_host.txt``): the median host seconds of a call and
its device seconds (CUDA events around it, a synchronize after each call, so each starts on an idle
host), the host seconds per call of the same calls queued back to back (``back_to_back``: the host's
work on warm caches, as in a denoise loop that does not wait for each step), the runner's own (``report()["graph"]``, its phases: the
key and checks, the inputs' copy, the launch, the rest), each graph's nodes by kind
(``census``), the profile's top entries, and each
per-call check timed alone (``checks``: the full hook scan against the watch of its dicts, the
resident tensors' addresses by a ``data_ptr`` loop against torch's one call, the current stream as a
``torch.cuda.Stream`` against its raw handle). Needs CUDA.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.graph_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="min", help="'min', 'resident' or GiB (default min)")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu runs the same calls eagerly (a dry run)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--device-launch-copies", action="store_true",
                   help="an experiment: device launch for graphs that stream units too (off in the product: "
                        "at full width such a graph ran 1.38x slower on the device in session 15)")
    p.add_argument("--full", action="store_true",
                   help="the Flux-dev-sized transformer (built on the device, offloaded from the host) instead of "
                        "the tiny-width tree: the device time then shows whether copies still overlap compute")
    p.add_argument("--resolution", type=int, default=512, help="image side with --full (default 512)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    import ddo_blocks
    from ddo_blocks.tiny import flux_inputs

    from .model import FLUX_DEV, TINY, make_inputs, random_model

    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu for a dry run)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if args.full and dev.type != "cuda":
        print("--full needs CUDA (the 22 GiB model is built on the device)", file=sys.stderr)
        return 2
    if args.full:
        model = random_model(FLUX_DEV, dev).to("cpu")
        side = args.resolution // 16
        x = make_inputs(model, height_tokens=side, width_tokens=side, text_tokens=512, device=dev,
                        dtype=torch.bfloat16)
        sync()
    else:
        model = random_model({**TINY, "num_layers": 19, "num_single_layers": 38}, torch.device("cpu"))
        x = flux_inputs(model)
    x = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    budget = (None if args.budget == "resident" else "min" if args.budget == "min"
              else int(float(args.budget) * (1 << 30)))
    handle = ddo_blocks.offload(model, vram_budget=budget, device=dev, graph=True, units="block")  # Flux's 57 units
    runner = handle.engine.scheduler.graph
    if args.device_launch_copies and runner is not None and runner.backend is not None:
        runner.backend.device_launch_copies = True
    host: list[float] = []
    device_s: list[float] = []
    with torch.no_grad():
        for _ in range(6):  # warm-up, the capture, a replay per slot state
            model(**x)
        sync()
        for _ in range(args.calls):
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            model(**x)
            host.append(time.perf_counter() - t0)
            if dev.type == "cuda":
                end.record()
                end.synchronize()
                device_s.append(start.elapsed_time(end) / 1e3)
            sync()
        # the runner's phases of the timed calls (the profiled ones below would inflate them)
        phases = runner.section()["host_phases_s"] if runner is not None else None
        # back to back: the host queues the calls without waiting for the device (as a pipeline's
        # denoise loop does), so its work runs on warm caches; a call above starts on an idle host
        # after a synchronize
        t0 = time.perf_counter()
        for _ in range(args.calls):
            model(**x)
        queued = time.perf_counter() - t0
        sync()
        drained = time.perf_counter() - t0
        back_to_back = {"host_call_s": queued / args.calls, "wall_call_s": drained / args.calls}
        prof = cProfile.Profile()
        for _ in range(args.calls):
            prof.enable()
            model(**x)
            prof.disable()
            sync()
    checks = _checks(model, handle, dev)
    census = _census(runner, dev)
    section = handle.report()["graph"]
    plan = handle.report()["plan"]
    handle.remove()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    doc = {"command": "python -m benchmarks.graph_host " + " ".join(argv if argv is not None else sys.argv[1:]),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "modules": sum(1 for _ in model.modules()), "parameters": sum(1 for _ in model.parameters()),
           "plan": {k: plan.get(k) for k in ("slots", "streamed_bytes", "resident_bytes", "units")},
           "device_launch_copies": args.device_launch_copies,
           "host_call_s": statistics.median(host), "host_call_min_s": min(host),
           "device_call_s": statistics.median(device_s) if device_s else None,
           "host_phases_s": phases, "back_to_back": back_to_back, "census": census, "checks": checks, "graph": section}
    print(json.dumps({k: v for k, v in doc.items() if k != "graph"}, indent=1))
    print(json.dumps(section, indent=1))
    print(text.getvalue())
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "graph_host.json").write_text(json.dumps(doc, indent=1))
        (args.out / "graph_host.txt").write_text(text.getvalue())
    return 0


def _census(runner: Any, dev: Any) -> list[dict[str, int]] | str:
    """Each captured graph's nodes by kind and its edges (``_native.graph_census``)."""
    from ddo_blocks import _native

    if runner is None or dev.type != "cuda":
        return "no graphs on this device"
    out = []
    for captured in runner._graphs.values():
        g = getattr(captured.graph, "g", None)
        if g is None or not getattr(captured.graph, "kept", False):
            return "this torch does not keep its graphs (keep_graph=True)"
        out.append(_native.graph_census(g.raw_cuda_graph(), dev.index or 0))
    return out


def _median_s(fn: Any, n: int = 500) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _checks(model: Any, handle: Any, dev: Any) -> dict[str, float]:
    """Each per-call check of a replay timed alone, median seconds."""
    import torch

    from ddo_blocks import _native
    from ddo_blocks.streaming.graph import Addresses

    runner = handle.engine.scheduler.graph
    scan = handle.engine.scheduler.hook_scan
    dicts = scan._dicts
    watch = _native.TreeWatch.snapshot(dicts)
    tensors = runner._params.tensors if runner is not None else list(model.parameters())
    addresses = Addresses(tensors)
    out = {
        "tensors_checked": len(tensors),
        "full_scan_s": _median_s(lambda: _native.scan_module_dicts(dicts)),
        "watched_dicts": len(watch) if watch is not None else 0,
        "watch_check_s": _median_s(watch.unchanged) if watch is not None else None,
        "addresses_loop_s": _median_s(lambda: [t.data_ptr() for t in tensors]),
        "addresses_torch_s": _median_s(addresses.same),
    }
    if dev.type == "cuda":
        out["current_stream_s"] = _median_s(lambda: torch.cuda.current_stream(dev).cuda_stream)
        out["raw_stream_s"] = _median_s(lambda: torch._C._cuda_getCurrentRawStream(dev.index))
    return out


if __name__ == "__main__":
    sys.exit(main())
