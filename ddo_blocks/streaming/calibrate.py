"""Calibration: one call of a component is timed unit by unit (compute of each unit, and how long
compute waited for copies), so the planner's simulator can predict the step time from measured
compute instead of its prior. Runs on the second call (the first one learns the order), costs a few
hundred timing events once, and changes nothing in the plan or the outputs."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


class _Stamp:
    """A point on the compute stream's timeline (CUDA event) or the host clock (CPU engine)."""

    __slots__ = ("event", "t")

    def __init__(self, device: torch.device):
        if device.type == "cuda":
            self.event: Any = torch.cuda.Event(enable_timing=True)
            self.event.record(torch.cuda.current_stream(device))
            self.t = 0.0
        else:
            self.event = None
            self.t = time.perf_counter()

    def seconds_to(self, later: _Stamp) -> float:
        if self.event is not None:
            later.event.synchronize()
            return self.event.elapsed_time(later.event) / 1e3
        return later.t - self.t


class Calibration:
    """Stamps of one call: call start/end, and per unit (wait start, compute start, compute end)."""

    def __init__(self, device: torch.device, resident_modules: list[tuple[int, nn.Module]]):
        self.device = device
        self.start = _Stamp(device)
        self.end: _Stamp | None = None
        self.wait: dict[int, _Stamp] = {}
        self.begin: dict[int, _Stamp] = {}
        self.finish: dict[int, _Stamp] = {}
        self._hooks = []
        for index, module in resident_modules:
            self._hooks.append(module.register_forward_pre_hook(self._pre(index)))
            self._hooks.append(module.register_forward_hook(self._post(index), always_call=True))
        self.result: dict[str, Any] | None = None

    def _pre(self, index: int):
        def hook(module, args):
            self.begin.setdefault(index, _Stamp(self.device))

        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            self.finish.setdefault(index, _Stamp(self.device))

        return hook

    def before_wait(self, index: int) -> None:
        self.wait.setdefault(index, _Stamp(self.device))

    def unit_begin(self, index: int) -> None:
        self.begin.setdefault(index, _Stamp(self.device))

    def unit_end(self, index: int) -> None:
        self.finish.setdefault(index, _Stamp(self.device))

    def covers(self, indices: list[int]) -> bool:
        """Whether every unit of ``indices`` began and finished in the call (a call through another
        entry point, ``vae.encode`` after ``vae.decode``, or an interrupted one, leaves some at 0 s)."""
        return all(i in self.begin and i in self.finish for i in indices)

    def close(self) -> None:
        self.end = _Stamp(self.device)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def resolve(self, n_units: int) -> dict[str, Any]:
        """Seconds: per-unit compute (by unit index), total wait, the rest of the call, the call."""
        if self.result is None:
            assert self.end is not None
            compute = [0.0] * n_units
            for i, b in self.begin.items():
                if i in self.finish:
                    compute[i] = max(0.0, b.seconds_to(self.finish[i]))
            wait = sum(max(0.0, w.seconds_to(self.begin[i])) for i, w in self.wait.items() if i in self.begin)
            call = self.start.seconds_to(self.end)
            self.result = {
                "unit_compute_s": compute,
                "wait_s": wait,
                "call_s": call,
                "rest_s": max(0.0, call - sum(compute) - wait),
            }
        return self.result
