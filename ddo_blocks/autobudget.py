"""``vram_budget="auto"``: a budget that picks itself from the device's free memory.

1. At attach: the device's free memory ``F`` (``cudaMemGetInfo`` plus what PyTorch's allocator holds
   unused), and a first budget of half of it (at least the route's minimum), so that the first call's
   activations, not known yet, have room.
2. The first call measures its activation peak ``A``: PyTorch's peak allocated during the call less
   what was allocated when it began (weights and slots included in the latter). Only a call that
   returns counts (an error or an interrupt: the next call measures). A first call that runs out of
   device memory (``A`` more than the first budget left) attaches the smallest plan; the error says
   so and to call again (the failed call is not run again for the caller: a call that failed
   half-way may have drawn random numbers or run hooks that keep state, so a second run could give
   another result than one call would).
3. The budget grows to ``F - A - margin`` (margin: 256 MiB plus 5 % of ``F``; ``F - 2A - margin`` when
   CUDA graphs may capture, ``graph=True``: their private pool keeps a call's activations beside the
   eager calls') when that is at least 10 % more than the first budget. Nothing streams at the first
   budget: nothing to re-plan. Otherwise the component is re-planned once (detached and attached
   again with the new budget) after the second call, which measures each unit's compute (the
   calibration call): the resident units are placed by that compute instead of the planner's prior
   (compute proportional to bytes; on Flux-sized blocks at child granularity the prior streams the
   modulation weights, which have almost no compute to hide their copy behind), and with
   ``units="auto"`` blocks and their children are both planned with it. A second call that ends in
   an error, or does not run every unit (another entry point), re-plans after the next clean call
   with the prior. If attaching at the new budget fails, the first budget is attached again.

The report's ``auto_budget`` section says what was measured and chosen. Without a CUDA device (the
CPU engine) there is no activation peak to measure: the first budget stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from .budget import fmt_bytes
from .errors import BudgetError

START_FRACTION = 0.5
"""The first budget: this fraction of the free memory."""

MARGIN_BYTES = 256 << 20
MARGIN_FRACTION = 0.05
"""Kept free beside the measured activations: allocator rounding, the caller's own tensors."""

REPLAN_GAIN = 0.10
"""Re-plan only when the budget grows by at least this fraction."""


def free_bytes(device: torch.device) -> int:
    """Memory the offload may use on ``device``: the driver's free memory plus what PyTorch's caching
    allocator holds without using it (CUDA); the available host memory for the CPU engine."""
    if device.type != "cuda":
        return int(psutil.virtual_memory().available)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))


class CallPeak:
    """The activation peak of one call: PyTorch's peak allocated during it, less what was allocated at
    its start. ``None`` on the CPU engine (nothing to measure)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start: tuple[int, int] | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._start = (torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device))

    def finish(self) -> int | None:
        if self._start is None:
            return None
        allocated0, peak0 = self._start
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        # without a reset, an earlier peak above this call's can only overstate the call's own
        return max(0, max(peak, peak0) - allocated0)


@dataclass
class AutoBudget:
    """The state of one ``vram_budget="auto"`` offload."""

    free_bytes: int
    minimum_bytes: int
    first_bytes: int
    activation_bytes: int | None = None
    replanned_bytes: int | None = None
    reason: str = "first call not run yet"
    done: bool = False
    pending_bytes: int | None = None
    """The grown budget, between the first call and the calibration call that re-plans with it."""
    measured_compute: bool = False
    """Whether the re-plan placed the units by the compute the calibration call measured."""
    pools: int = 1
    """How many times the activations are kept free: 2 when CUDA graphs may capture (``graph=True``
    on an engine that can: their private pool holds a call's activations beside the eager calls')."""
    calibration_unclean: bool = False
    """The second call ended in an error: the re-plan waits for a clean call and uses the prior."""
    out_of_memory_bytes: int | None = None
    """The first budget, where the first call ran out of device memory there and the component was
    attached at its smallest plan (``OffloadHandle``), else ``None``."""
    peak: CallPeak | None = field(default=None, repr=False)

    @classmethod
    def at_attach(cls, device: torch.device, minimum: int, what: str) -> AutoBudget:
        """The first budget for a component whose smallest plan needs ``minimum`` bytes."""
        free = free_bytes(device)
        if minimum + MARGIN_BYTES > free:
            raise BudgetError(
                f"vram_budget='auto': {what} needs at least {fmt_bytes(minimum)} on {device} (its smallest plan) "
                f"plus room for activations, and {fmt_bytes(free)} is free; free device memory, or pass a budget "
                "(bytes, a size such as '6GiB', or 'min')"
            )
        first = min(max(minimum, int(free * START_FRACTION)), free - MARGIN_BYTES)
        return cls(free, minimum, first, peak=CallPeak(device))

    def grown(self, activations: int) -> int:
        """The budget once the activations are known."""
        return int(self.free_bytes - self.pools * activations - MARGIN_BYTES - MARGIN_FRACTION * self.free_bytes)

    def decide(self) -> int | None:
        """After the first call: the budget to re-plan with, or ``None`` (keep the first one)."""
        self.done = True
        act = self.peak.finish() if self.peak is not None else None
        self.activation_bytes = act
        if act is None:
            self.reason = "no activation peak to measure on this device: the first budget stays"
            return None
        new = self.grown(act)
        twice = " twice (the graphs' pool and the eager calls')" if self.pools == 2 else ""
        if new < self.first_bytes * (1 + REPLAN_GAIN):
            self.reason = (f"free {fmt_bytes(self.free_bytes)} less the first call's activations "
                           f"{fmt_bytes(act)}{twice} and the margin leave {fmt_bytes(max(new, 0))}: not 10 % above "
                           "the first budget, which stays")
            return None
        self.reason = (f"free {fmt_bytes(self.free_bytes)} less the first call's activations {fmt_bytes(act)}{twice} "
                       f"and a margin of {fmt_bytes(self.free_bytes - self.pools * act - new)}")
        return new

    def section(self) -> dict[str, Any]:
        reason = self.reason
        if self.out_of_memory_bytes is not None and self.done:
            reason = (f"the first call ran out of device memory at the first budget {fmt_bytes(self.out_of_memory_bytes)}"
                      f" and ran at the smallest plan ({fmt_bytes(self.first_bytes)}); " + reason)
        return {
            "free_bytes": self.free_bytes,
            "minimum_bytes": self.minimum_bytes,
            "first_budget_bytes": self.first_bytes,
            "activation_bytes": self.activation_bytes,
            "replanned_budget_bytes": self.replanned_bytes,
            "pending_budget_bytes": self.pending_bytes,
            "measured_compute": self.measured_compute,
            "activation_pools": self.pools,
            "out_of_memory_at_bytes": self.out_of_memory_bytes,
            "reason": reason + (": the re-plan waits for the second call, which measures each unit's compute"
                                     if self.pending_bytes is not None else ""),
        }
