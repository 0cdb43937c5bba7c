"""The plan of a streamed component: its units at a granularity (blocks, or each block's children),
which units stay resident and how many slots stream the rest (the Rust planner), and the
simulator's step time with calibrated compute."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import _native
from ..budget import fmt_bytes
from ..errors import BudgetError, ConfigError, PlanError
from ..routes.spec import Preset
from ..units import GRANULARITIES, Unit, span_nbytes, split_units, tensor_nbytes
from . import bandwidth


@dataclass(frozen=True)
class UnitPlan:
    """Units, their slot sizes, the always-resident bytes and the planner's choice."""

    granularity: str
    units: list[Unit]
    leftovers: list[tuple[str, nn.Parameter]]
    unit_bytes: list[int]
    """Each unit's size in a slot (its tensors at aligned offsets)."""
    base_bytes: int
    """Always-resident bytes: parameters outside units and every buffer."""
    native: _native.Plan
    """The planner's result: ``resident`` flags, ``slots``, ``predicted_step_s``, ..."""
    link_bytes: list[int] | None = None
    """Bytes each unit sends over the link when streamed, where a codec makes them fewer than
    ``unit_bytes`` (its estimate before encoding)."""

    @property
    def streamed(self) -> list[Unit]:
        return [u for u, r in zip(self.units, self.native.resident) if not r]

    @property
    def resident_units(self) -> list[Unit]:
        return [u for u, r in zip(self.units, self.native.resident) if r]


def check_granularity(units: str) -> str:
    if units not in ("auto", *GRANULARITIES):
        raise ConfigError(f"units={units!r} is not a unit granularity; use 'auto', 'block' or 'child'")
    return units


def buffer_bytes(module: nn.Module) -> int:
    return sum(tensor_nbytes(b) for b in module.buffers())


def unit_sizes(units: list[Unit]) -> list[int]:
    """Each unit's slot size: its tensors, each over the storage it spans, at aligned offsets."""
    return [_native.layout_unit([span_nbytes(p) for _, p in u.params]).nbytes for u in units]


CHILD_GAIN = 0.97
"""``units="auto"`` takes each block's children as units only when they predict a step at most this
fraction of the blocks' (more, smaller copies per step)."""

LinkBytes = Callable[[list[Unit]], list[int]]
"""Per unit, the bytes it sends over the link when streamed (a codec's estimate)."""

@dataclass(frozen=True)
class Measured:
    """What an earlier plan of a module measured, to plan it again with (``OffloadHandle.replan``):
    its granularity, each unit's compute seconds (with the decode of the units a codec is to code),
    and, with a codec, the bytes each unit sends, which units are coded and with which codec."""

    granularity: str
    unit_compute_s: list[float]
    link_bytes: list[int] | None = None
    coded: list[bool] | None = None
    codec: str | None = None
    """The codec of the store (``codec="lossless"`` may change it: ``off``, ``fixed``, ``tiered``), or
    ``None`` for the route's own."""


ComputeBytes = Callable[[list[Unit]], list[int]]
"""Per unit, the bytes its compute is estimated from, when not its stored size: a packed layer
(SDNQ) computes with its dequantized weight, so its compute scales with that, not with the bytes
it streams."""


def _plan(module: nn.Module, granularity: str, budget: int | None, device: torch.device, link: float,
          preset: Preset, link_bytes: LinkBytes | None = None, compute_bytes: ComputeBytes | None = None,
          measured: Measured | None = None) -> UnitPlan:
    units, leftovers = split_units(module, granularity)
    if not units:
        raise PlanError(
            f"{type(module).__name__} has no unit to stream: every weight is shared between its layers or belongs to "
            "no layer of its own, so nothing can leave the device on its own; use route='resident'"
        )
    base = sum(tensor_nbytes(p) for _, p in leftovers) + buffer_bytes(module)
    sizes = unit_sizes(units)
    sent = link_bytes(units) if link_bytes is not None else None
    if measured is not None and measured.link_bytes is not None:
        sent = list(measured.link_bytes)
    unit_compute_s = measured.unit_compute_s if measured is not None else None
    rate = bandwidth.compute_bytes_per_s(device, link)
    native = _native.plan(
        sizes,
        base_bytes=base,
        budget_bytes=budget,
        link_bytes_per_s=link,
        compute_bytes_per_s=rate,
        min_slots=preset.min_slots,
        max_slots=preset.max_slots,
        unit_compute_s=(unit_compute_s if unit_compute_s is not None
                        else [b / rate for b in compute_bytes(units)] if compute_bytes is not None else None),
        link_bytes=sent,
    )
    return UnitPlan(granularity, units, leftovers, sizes, base, native, sent)


def choose(module: nn.Module, budget: int | None, device: torch.device, link: float, preset: Preset,
           units: str = "auto", reserve: int = 0, link_bytes: LinkBytes | None = None,
           compute_bytes: ComputeBytes | None = None, measured: Measured | None = None,
           reserve_for: tuple[str, str] = ("landing buffers the codec needs", "or pass codec='off'")) -> UnitPlan:
    """Blocks as units, unless the budget needs smaller units or the planner predicts a clearly
    faster step with each block's children as units (smaller slots leave more budget resident).
    ``reserve``: device bytes needed beside the weights and slots (a codec's landing buffers);
    ``link_bytes``: what each unit sends over the link, when not its size (a codec);
    ``compute_bytes``: what each unit's compute is estimated from, when not its size (packed layers);
    ``measured``: what an earlier plan measured (:class:`Measured`): its granularity, planned with
    those compute times (and link bytes); ``reserve_for``: what the reserve is and what else would
    work, for the errors."""
    if reserve and budget is not None:
        what, instead = reserve_for
        if budget <= reserve:
            raise BudgetError(
                f"VRAM budget {fmt_bytes(budget)} does not even hold the {fmt_bytes(reserve)} of {what}; pass a larger "
                f"vram_budget (at least {fmt_bytes(reserve)} more than vram_budget='min'), {instead}"
            )
        try:
            return choose(module, budget - reserve, device, link, preset, units, link_bytes=link_bytes,
                          compute_bytes=compute_bytes, measured=measured)
        except BudgetError as exc:
            raise BudgetError(
                f"{exc} (after the {fmt_bytes(reserve)} of {what}: add them to the budget, {instead})"
            ) from exc
    if measured is not None:
        return _plan(module, measured.granularity, budget, device, link, preset, link_bytes, compute_bytes, measured)
    if check_granularity(units) != "auto":
        return _plan(module, units, budget, device, link, preset, link_bytes, compute_bytes)
    try:
        block = _plan(module, "block", budget, device, link, preset, link_bytes, compute_bytes)
    except BudgetError:
        # its error, if any, names the lower minimum
        return _plan(module, "child", budget, device, link, preset, link_bytes, compute_bytes)
    if block.native.slots == 0:
        return block  # everything fits: nothing streams
    child = _plan(module, "child", budget, device, link, preset, link_bytes, compute_bytes)
    if len(child.units) > len(block.units) and child.native.predicted_step_s < CHILD_GAIN * block.native.predicted_step_s:
        return child
    return block


def minimum_budget(module: nn.Module, units: str = "auto") -> int:
    """The smallest budget the planner accepts: always-resident weights plus two slots of the
    largest unit, at the given granularity (``auto``: the lower of blocks and their children)."""
    best = None
    for granularity in GRANULARITIES if check_granularity(units) == "auto" else (units,):
        found, leftovers = split_units(module, granularity)
        base = sum(tensor_nbytes(p) for _, p in leftovers) + buffer_bytes(module)
        need = _native.minimum_budget(unit_sizes(found), base).bytes
        best = need if best is None else min(best, need)
    return int(best)


def simulate(unit_plan: UnitPlan, unit_compute_s: list[float], slots: int, link: float,
             disk: tuple = ()) -> tuple[float, float]:
    """The simulator's steady step and compute wait for this plan with the given compute times
    (``disk``: which units come from disk and the disk's rate, for the NVMe route). The step is the
    planner's: the last simulated pass, never less than the copies' time per pass."""
    sim = _native.simulate(
        unit_plan.link_bytes or unit_plan.unit_bytes, unit_compute_s, unit_plan.native.resident, max(slots, 1), link, 4, *disk,
    )
    return max(sim.step_s, sim.link_busy_s), sim.compute_wait_s
