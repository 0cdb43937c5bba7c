"""The host work of a replayed call on the CPU (session 17): Flux's module tree at tiny width (19 + 38
blocks, 57 block units) offloaded with graph=True, the graph runner given a backend whose replay
launches nothing, so a call's host time is the runner's own (signature, hook scan, module state,
inputs' copy, the rest). Run from the repository root:

    .venv/bin/python benchmarks/results/2026-12-03-cpu-session17/replay_host.py min|FRACTION
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import ddo_blocks  # noqa: E402
from benchmarks.model import TINY, random_model  # noqa: E402
from ddo_blocks.streaming.graph import GraphRunner  # noqa: E402
from ddo_blocks.tiny import flux_inputs  # noqa: E402


class NoLaunch:
    """A capture runs the call's Python and leaves the slots as they were; a replay launches nothing."""

    def __init__(self, engine):
        self.engine = engine

    def capture(self, body, stream):
        slots = self.engine.slots.storage
        before = slots.clone()
        out = body()
        slots.copy_(before)
        return out, out

    def replay(self, graph):
        pass


model = random_model({**TINY, "num_layers": 19, "num_single_layers": 38}, torch.device("cpu"))
x = flux_inputs(model)
arg = sys.argv[1] if len(sys.argv) > 1 else "min"
weights = sum(p.numel() * p.element_size() for p in model.parameters())
budget = ddo_blocks.minimum_budget(model, units="block") if arg == "min" else int(weights * float(arg))
handle = ddo_blocks.offload(model, vram_budget=budget, device="cpu", graph=True, units="block")
sched = handle.engine.scheduler
runner = GraphRunner(sched, handle.engine, backend=NoLaunch(handle.engine))
runner.off_reason = None  # the CPU engine has no graphs: the stand-in takes their place
sched.graph = runner
print("parameters", sum(1 for _ in model.parameters()), "resident tensors", len(runner._params.tensors),
      "modules", len(sched.modules))
with torch.no_grad():
    for _ in range(12):  # warm-up, captures
        model(**x)
    for name in ("call_s", "host_s", "signature_s", "hooks_s", "state_s", "inputs_s", "launch_s"):
        getattr(runner.stats, name).clear()
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        model(**x)
        times.append(time.perf_counter() - t0)
print("replays", runner.stats.replays, "median call %.1f us" % (statistics.median(times) * 1e6))
print("phases us", {k: round(v * 1e6, 1) for k, v in runner._phases().items()})
