"""The public offload API: ``offload()`` and the ``OffloadHandle`` it returns, plus
``enable_offload()`` for users coming from the original DDO."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from . import _native, env, routes
from .autobudget import REPLAN_GAIN, AutoBudget
from .budget import fmt_bytes, parse_bytes
from .errors import ConfigError, CudaNotAvailableError, OffloadStateError
from .report import Report, build_report
from .routes.spec import Engine, EngineRequest, Preset, UnitInfo
from .streaming import formats, guards

_ATTR = "_ddo_offload"
log = logging.getLogger("ddo_blocks")
_UNUSABLE_ATTR = "_ddo_unusable"
"""Set on a module that a failed removal left without some of its weights."""

REPLAN_MIN_GAIN = 0.05
"""``OffloadHandle.replan`` attaches the measured plan when it is predicted this much faster."""

LOSSLESS_TIE = 1e-6
"""Predicted gains smaller than this are ties (the simulator and the planner round differently): kept."""

LOSSLESS_REPLAN_GAIN = 0.02
"""``codec="lossless"`` attaches again after the second call when the compute it measured makes
another coding (codec, or fraction of the units coded) predicted this much faster; one that codes
fewer units, when it is predicted at least as fast (the decode shares the SMs with the model); the
same coding in another plan (slots, resident units), when it codes and that is predicted
:data:`REPLAN_MIN_GAIN` faster (as ``replan()``)."""


def resolve_device(device: str | torch.device) -> torch.device:
    """Parses ``device`` and checks it can be used, before anything moves.

    Raises:
        CudaNotAvailableError: a CUDA device was asked on a machine without a usable driver or GPU.
        ConfigError: the device is not ``cpu`` or ``cuda[:N]``.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is not a device; use 'cuda', 'cuda:N' or 'cpu'") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device={device!r} is not supported; use 'cuda', 'cuda:N' or 'cpu'")
    reason = _native.cuda_unavailable_reason()  # says what to do itself
    if reason is None and not torch.cuda.is_available():
        reason = ("PyTorch reports no CUDA device (a CPU-only build of torch, or CUDA_VISIBLE_DEVICES is empty); "
                  "use device='cpu' here")
    if reason is not None:
        raise CudaNotAvailableError(f"device={str(device)!r} was asked but {reason}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise CudaNotAvailableError(
            f"device={str(device)!r} was asked but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


class OffloadHandle:
    """One offloaded component. ``module`` is the same object that was passed in.

    Use ``report()`` for what the offload did (plan, setup, per-call timings, memory) and ``remove()``
    to restore the module exactly (same parameters, same values, same devices as before).
    """

    def __init__(self, module: nn.Module, engine: Engine, *, route: str, preset: Preset, requested: str,
                 component: str | None, vram_budget: int | None, device: torch.device):
        self.module = module
        self.engine = engine
        self.route = route
        self.preset = preset
        self.requested_preset = requested
        self.component = component or type(module).__name__
        self.vram_budget = vram_budget
        self.device = device
        self._removed = False
        self._guard: guards.ConversionGuard | None = None
        self.auto: AutoBudget | None = None
        """The ``vram_budget="auto"`` state (what was measured and chosen), or None."""
        self._smallest = 0
        """``auto``: the route's smallest plan, where a first call that ran out of memory goes."""
        self._squeezed = False
        """On an ``Arena("auto")``: the first call ran out of device memory (:meth:`_arena_first_call_oom`)."""
        self._rebuild: tuple[routes.RouteSpec, dict[str, Any]] | None = None
        """The route and its options: what ``replan`` and the auto budget attach again with."""
        self.lossless: dict[str, Any] | None = None
        """``codec="lossless"``: what its re-plan after the second call decided (the report's ``codec``
        section), or None."""

    @property
    def removed(self) -> bool:
        return self._removed

    @property
    def plan(self) -> _native.Plan | None:
        """The planner's choice (streaming routes), a frozen ``Plan``: ``resident`` flags per unit,
        ``slots``, ``slot_bytes``, ``gpu_bytes``, ``predicted_step_s``, ... (``to_dict()`` for JSON);
        None for the other routes."""
        return getattr(self.engine, "plan", None)

    @property
    def units(self) -> tuple[UnitInfo, ...]:
        """The component's units in definition order, each streamed or resident (streaming routes;
        empty for the others)."""
        return self.engine.unit_infos()

    def report(self) -> Report:
        """The measured record of this offload (see ``ddo_blocks.report``)."""
        return build_report(self)

    # -- vram_budget="auto" ---------------------------------------------------------------------------
    def _auto_budget(self, auto: AutoBudget, spec: routes.RouteSpec, options: dict[str, Any]) -> None:
        """Measures the first call's activations and re-plans once, after the second call when units
        stream (it measures each unit's compute), else after the first (``autobudget``)."""
        self.auto = auto
        if spec.needs_files:
            auto.done = True  # re-planning would read every disk unit back into RAM
            auto.reason = f"route {spec.name!r} reads weights from files: the first budget stays"
            return
        self._smallest = auto.minimum_bytes + (spec.min_extra(self.module, options) if spec.min_extra else 0)
        self._wire_auto()

    def _wire_auto(self) -> None:
        engine, auto = self.engine, self.auto
        if not hasattr(engine, "after_entry_call") or auto.done:
            return
        engine.on_call_start = auto.peak.start
        engine.after_entry_call = self._after_first_call
        engine.on_oom = self._first_call_oom

    def _after_first_call(self) -> None:
        engine, auto = self.engine, self.auto
        if not engine.scheduler.last_call_clean:
            return  # an error or an interrupt: its peak is part of a call; the next clean call measures
        engine.on_call_start = engine.after_entry_call = engine.on_oom = None
        runner = getattr(getattr(engine, "scheduler", None), "graph", None)
        if runner is not None and runner.off_reason is None:
            auto.pools = 2  # the graphs' pool keeps a call's activations beside the eager calls'
        if not getattr(engine, "streamed", None):
            auto.done = True
            auto.reason = "everything fits at the first budget: nothing streams, nothing to re-plan"
            return
        new = auto.decide()
        if new is None:
            self._wire_lossless_if_asked()  # the budget stays: codec="lossless" still weighs its coding
            return
        if hasattr(engine, "measured_for"):
            # The next call measures each unit's compute (the calibration call): the re-plan waits
            # for it, so that the one re-plan places the resident units by measured compute, not by
            # the prior's bytes (a block's modulation weights stream without compute to hide them).
            auto.pending_bytes = new
            engine.after_entry_call = self._after_calibration_call
            return
        self._auto_replan(new, None, "after the first call")

    def _after_calibration_call(self) -> None:
        engine, auto = self.engine, self.auto
        if not engine.scheduler.last_call_clean and not auto.calibration_unclean:
            # an error or an interrupt: no re-pack while it unwinds; the next clean call re-plans, with
            # the prior (the calibration is the second call's only)
            auto.calibration_unclean = True
            return
        engine.after_entry_call = None
        new, auto.pending_bytes = auto.pending_bytes, None
        measured = None if auto.calibration_unclean else engine.measured_for(new)
        when = ("after the second call with each unit's compute it measured" if measured is not None else
                "after a clean call, with the planner's prior: the second call "
                + ("did not finish cleanly" if auto.calibration_unclean else
                   "did not run every unit, or no plan with its measurement fits"))
        self._auto_replan(new, measured, when)

    def _first_call_oom(self, exc: BaseException) -> None:
        """The first call ran out of device memory (its activations, not known yet, did not fit beside
        the first budget): attaches the smallest plan, whose next call measures the activations with
        the most room, and says so in a note on ``exc``. The call is not run again here: a call that
        failed half-way may have drawn random numbers, run a user's hooks or changed state no check
        sees, so running it again could give another result than one call would; the caller does."""
        auto, first = self.auto, self.vram_budget
        where = f"ddo_blocks: {self.component} (vram_budget='auto')"
        if first is None or first <= self._smallest:
            exc.add_note(f"{where} ran out of device memory at its smallest plan ({fmt_bytes(self._smallest)} of "
                         "weights on the device): the call's activations do not fit beside it. Free device memory, "
                         "or make the call smaller (resolution, frames, batch)")
            return
        if self._from_device(exc, where):
            return
        failed = self._attach_again(self._smallest, fallback_budget=first)
        if failed is not None:
            exc.add_note(f"{where} ran out of device memory at the first budget {fmt_bytes(first)}; attaching "
                         f"its smallest plan then failed ({failed}), and the first budget is attached again")
            return
        self.vram_budget = auto.first_bytes = self._smallest
        auto.out_of_memory_bytes = first
        auto.reason = (f"the first call ran out of device memory at the first budget {fmt_bytes(first)}: attached "
                       f"at the smallest plan ({fmt_bytes(self._smallest)}), whose call measures the activations")
        self._wire_auto()
        exc.add_note(f"{where} ran out of device memory at the first budget {fmt_bytes(first)} (its activations "
                     f"were not known yet) and is attached at its smallest plan ({fmt_bytes(self._smallest)}) now: "
                     "call it again; that call measures the activations, and the budget grows after it")
        log.warning("%s: the first call ran out of device memory at %s; attached at the smallest plan (%s)",
                    where, fmt_bytes(first), fmt_bytes(self._smallest))

    def _auto_replan(self, new: int, measured: Any, when: str) -> None:
        """Attaches the component again at the budget ``auto`` chose (planned with ``measured``
        compute when given); a failed attach attaches the first budget again."""
        auto = self.auto
        failed = self._attach_again(new, fallback_budget=self.vram_budget, measured=measured)  # the call is done
        if failed is not None:  # the first budget worked: it is attached again
            auto.reason += f"; attaching at {new} bytes failed ({failed}), the first budget was attached again"
            log.warning("ddo_blocks: %s: %s", self.component, auto.reason)
            return
        self.vram_budget = new
        auto.replanned_bytes = new
        auto.measured_compute = measured is not None
        auto.reason = f"re-planned {when}: {auto.reason}"
        log.info("ddo_blocks: %s: vram_budget='auto' %s", self.component, auto.reason)

    # -- codec="lossless" ------------------------------------------------------------------------------
    def _wire_lossless_if_asked(self) -> None:
        if self._rebuild is not None and self._rebuild[1].get("codec") == "lossless" and \
                self._rebuild[0].codec_reserve is None and getattr(self.engine, "after_entry_call", 0) is None:
            self._wire_lossless()

    def _wire_lossless(self) -> None:
        """After the second call (the calibration call, which measures each unit's compute), weighs the
        codings again with that compute and attaches the best once (:meth:`_after_lossless_call`)."""
        self.lossless = {"replan": "pending: after the second call"}
        if not getattr(self.engine, "streamed", None):
            self.lossless["replan"] = "none: nothing streams"
            return
        self.engine.after_entry_call = self._after_lossless_call

    def _after_lossless_call(self) -> None:
        engine, note = self.engine, self.lossless
        cal = engine.scheduler.calibration
        if cal is None or cal.end is None:
            return  # the first call: the second measures
        engine.after_entry_call = None
        better = engine.measured_plan() if engine.scheduler.last_call_clean else None
        if better is None:
            note["replan"] = "none: the second call did not run every unit to its end cleanly"
            return
        chosen = better["measured"]
        now_codec = getattr(engine.store, "codec", "off")
        now_coded = engine.coded_now()
        new_codec = chosen.codec or now_codec
        coded_now, coded_new = any(now_coded), any(chosen.coded or ())
        note.update(measured_choice=new_codec if coded_new else "off",
                    measured_coded_fraction=better["coded_fraction"], predicted_gain=better["gain"],
                    measured_candidates_s=better["candidates_s"])
        same = engine.same_coding(chosen) or not coded_now and not coded_new
        if same:
            # the same coding in another plan (slots, resident set), as replan() would attach it: where
            # it codes (the prior plans a coded store's units from their bytes, with the landing
            # buffers' reserve; the uncompressed plan is replan()'s business, as with codec="off")
            if better["same_plan"]:
                note["replan"] = "kept: the measured compute chooses the same coding and plan"
                return
            if not coded_now:
                note["replan"] = ("kept: nothing is coded, and the measured compute codes nothing (another plan of the "
                                  "uncompressed units is replan()'s)")
                return
            if better["gain"] is None or better["gain"] < REPLAN_MIN_GAIN:
                note["replan"] = (f"kept: the measured compute chooses the same coding, in a plan predicted less than "
                                  f"{REPLAN_MIN_GAIN:.0%} faster")
                return
            need = REPLAN_MIN_GAIN
        else:
            # coding more must pay for the re-build; coding less (decode the model's SMs do not need)
            # must only not be predicted slower
            need = 0.0 if sum(chosen.coded or ()) < sum(now_coded) else LOSSLESS_REPLAN_GAIN
        if better["gain"] is None or better["gain"] < need or abs(better["gain"]) < LOSSLESS_TIE:
            note["replan"] = (f"kept: the measured choice is predicted less than {need:.0%} faster" if need else
                              "kept: coding less is not predicted faster")
            return
        t0 = time.perf_counter()
        failed = self._attach_again(self.vram_budget, measured=chosen, fallback_budget=self.vram_budget)
        if failed is not None:
            note["replan"] = f"failed ({failed}); the prior's choice was attached again"
            log.warning("ddo_blocks: %s: codec='lossless' re-plan failed (%s)", self.component, failed)
            return
        attached = self.engine.plan
        moved = (f"the same coding in a plan of {attached.slots} slots and {sum(attached.resident)} resident units"
                 if same else f"{now_codec if coded_now else 'off'} -> {new_codec if coded_new else 'off'}")
        note["replan"] = f"re-planned after the second call: {moved}, predicted {better['gain']:.1%} faster"
        note["replan_s"] = time.perf_counter() - t0
        log.info("ddo_blocks: %s: codec='lossless' %s", self.component, note["replan"])

    def _wire_arena(self) -> None:
        """An arena member: the re-plan after its first clean call (``Arena("auto")``), and on such an
        arena what its first call running out of device memory does."""
        engine = self.engine
        engine.after_entry_call = self._arena_replan
        if engine.slots.member.arena.auto is not None:
            engine.on_oom = self._arena_first_call_oom

    def _arena_replan(self) -> None:
        """On an ``Arena("auto")``, after the first call: plans the component again, once, with the budget
        its phase has now that its activations are measured (``arena.AutoArena``), when that is at least
        10 % more than it planned with; a failed attach attaches the first plan again."""
        engine = self.engine
        if not engine.scheduler.last_call_clean:
            return  # an error or an interrupt measured nothing: the next clean call does
        engine.after_entry_call = engine.on_oom = None
        new = engine.slots.replan_budget(self.vram_budget is None or self._squeezed)
        if new is not None and self.vram_budget is not None:  # squeezed below a budget of its own: back to it
            new = min(new, self.vram_budget)
            if new < engine.budget * (1 + REPLAN_GAIN):
                return
        if new is None:
            return
        engine.slots.enter_own_phase()  # the arena's budget is this component's phase now: it plans with it
        failed = self._attach_again(self.vram_budget, fallback_budget=engine.budget)
        if failed is not None:
            log.warning("ddo_blocks: %s: re-planning on the auto arena failed (%s); the first plan's budget is "
                        "attached again", self.component, failed)
            return
        log.info("ddo_blocks: %s: re-planned on the auto arena with %s", self.component, fmt_bytes(new))

    def _from_device(self, exc: BaseException, where: str) -> bool:
        """Whether the module's weights came from the device: attaching it again would first put every
        weight back there, beside the failed call's activations (a note on ``exc`` says what to do)."""
        if not any(d.type != "cpu" for d in getattr(self.engine, "orig_device", {}).values()):
            return False
        exc.add_note(f"{where} ran out of device memory at its first call; the module came from the device, where "
                     "attaching it again would first put every weight back: remove() the offload and pass a smaller "
                     "vram_budget (bytes or 'min')")
        return True

    def _arena_first_call_oom(self, exc: BaseException) -> None:
        """On an ``Arena("auto")``, the component's first call ran out of device memory (its activations,
        not known yet, did not fit beside the arena's first budget): its phase holds only what it holds
        itself from now until its activations are measured (the others' chunks go back to the driver at
        its next call), it is attached at its smallest plan, and a note on ``exc`` says to call again (not
        re-run here: see :meth:`_first_call_oom`). After that call measures, it is planned again once
        with its phase's budget (:meth:`_arena_replan`)."""
        engine = self.engine
        arena = engine.slots.member.arena
        where = f"ddo_blocks: {self.component} (Arena('auto'))"
        spec, options = self._rebuild
        smallest = _budget("min", self.module, spec, options, self.device)
        if self._squeezed and engine.budget <= smallest:
            exc.add_note(f"{where} ran out of device memory at its smallest plan ({fmt_bytes(smallest)}), the arena "
                         "holding nothing of the other components in its phase: the call's activations do not fit "
                         "beside it. Free device memory, or make the call smaller (resolution, frames, batch)")
            return
        if self._from_device(exc, where):
            return
        arena.auto.squeezed.add(engine.slots.member.name)
        self._squeezed = True
        if engine.budget > smallest:
            failed = self._attach_again(smallest, fallback_budget=self.vram_budget)
            if failed is not None:
                exc.add_note(f"{where} ran out of device memory at its first call; attaching its smallest plan "
                             f"failed ({failed}), the first plan is attached again")
                self._wire_arena()
                return
        self._wire_arena()
        exc.add_note(f"{where} ran out of device memory at its first call (its activations were not known yet): it "
                     f"is attached at its smallest plan ({fmt_bytes(smallest)}) and its phase keeps no chunk of the "
                     "other components now: call it again; that call measures the activations, and the component "
                     "is planned again after it with its phase's budget (within a budget of its own, if given)")
        log.warning("%s: the first call ran out of device memory; attached at the smallest plan (%s)", where,
                    fmt_bytes(smallest))

    def _attach_again(self, budget: int | None, *, fallback_budget: int | None, measured: Any = None) -> Exception | None:
        """Detaches the engine and attaches a new one of the same route and options planned with
        ``budget`` (and ``measured``); if that attach fails, one planned with ``fallback_budget`` and no
        measurement (the plan that worked). Returns the first attempt's error, or ``None``; if the second
        attach fails too, the handle is removed (the detached module is as it was before ``offload()``)
        and ``OffloadStateError`` says so."""
        spec, options = self._rebuild
        self.engine.detach()

        def build(b: int | None, m: Any) -> tuple[Preset, Any]:  # fresh options each time: the factory takes them
            chosen, fresh = spec.factory(EngineRequest(self.module, self.requested_preset, b, self.device,
                                                       dict(options), None, m, component=self.component))
            fresh.attach()
            return chosen, fresh

        try:
            self.preset, self.engine = build(budget, measured)
        except Exception as exc:  # noqa: BLE001 - out of host memory too: the plan that worked goes back
            try:
                _, self.engine = build(fallback_budget, None)
            except Exception as again:
                self._forget()  # detached above: the module is as it was before offload(), and says so
                raise OffloadStateError(
                    f"{self.component}: attaching it again failed ({type(exc).__name__}: {exc}), and so did attaching "
                    f"the plan that worked ({type(again).__name__}: {again}): the offload is removed and the module is "
                    "as it was before offload() (its weights where they were); offload() it again"
                ) from again
            return exc
        return None

    # -- re-planning with measured compute -------------------------------------------------------------
    def replan(self, min_gain: float = REPLAN_MIN_GAIN) -> bool:
        """Plans this offload again with the compute its units measured on the second call (the
        calibration call) instead of the planner's prior, and attaches that plan when the simulator
        predicts it at least ``min_gain`` faster (the report's ``plan.measured_plan_gain``). Same
        route, preset, budget and granularity; the host copy is built again (seconds for a large
        model, once). Returns whether the plan changed. A failed attach attaches the old plan again.

        Raises:
            OffloadStateError: removed, or no calibration yet (call the module twice first); or the new plan's
                attach failed and so did the old one's: the offload is removed, the module as before offload().
        """
        if self._removed:
            raise OffloadStateError(f"the offload of {self.component} was removed; offload() the module again")
        better = self.engine.measured_plan() if hasattr(self.engine, "measured_plan") else None
        if better is None:
            raise OffloadStateError(
                f"{self.component}: nothing measured to re-plan with: call the module twice first (the second call "
                "measures each unit's compute, and must run every unit: a VAE's encode measures no decoder unit); "
                "offloads that stream nothing, and the NVMe route, do not re-plan"
            )
        if better["same_plan"] or better["gain"] is None or better["gain"] < min_gain or self._rebuild is None:
            return False
        failed = self._attach_again(self.vram_budget, measured=better["measured"], fallback_budget=self.vram_budget)
        if failed is not None:
            log.warning("ddo_blocks: %s: re-planning failed (%s); the earlier plan is attached again", self.component,
                        failed)
            return False
        log.info("ddo_blocks: %s re-planned with measured compute: predicted %.4f s against %.4f s",
                 self.component, better["predicted_step_s"], better["current_predicted_step_s"])
        return True

    def remove(self) -> None:
        """Removes the offload and restores the module.

        Raises:
            OffloadStateError: already removed, or called while the module is running.
        """
        if self._removed:
            raise OffloadStateError(
                f"the offload of {self.component} was already removed; offload() the module again to reuse it"
            )
        try:
            self.engine.detach()
            log.info("removed the offload of %s", self.component)
        finally:
            # An engine whose removal failed part-way says whether the offload is still in place (then
            # it keeps working and remove() can be retried) or gone (then so is this handle).
            if not getattr(self.engine, "attached", False):
                self._forget()

    def _forget(self) -> None:
        self._removed = True
        if self.auto is not None and self.auto.pending_bytes is not None:
            self.auto.pending_bytes = None
            self.auto.reason += ": removed before the re-plan"
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if getattr(self.module, _ATTR, None) is self:
            delattr(self.module, _ATTR)
        lost = getattr(self.engine, "lost", None)
        if lost:
            self.module.__dict__[_UNUSABLE_ATTR] = (
                f"{len(lost)} of its tensors ({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}) could not be "
                "read back when the NVMe offload was removed (a checkpoint file changed) and are NaN placeholders"
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._removed:
            self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return (f"OffloadHandle({self.component}, route={self.route!r}, preset={self.preset.name!r}, "
                f"device={str(self.device)!r}, {state})")


def offload(
    module: nn.Module,
    *,
    route: str = "linear",
    preset: str = "auto",
    vram_budget: int | str | None = None,
    device: str | torch.device = "cuda",
    component: str | None = None,
    **options: Any,
) -> OffloadHandle:
    """Offloads a module's weights so it runs within a VRAM budget.

    Everything is validated before any weight moves; on any error the module is left as it was.

    Args:
        module: the component (a diffusers model, a transformers encoder, any ``nn.Module``).
        route: ``"linear"`` (stream through GPU slots), ``"resident"``, ``"off"``, ``"diffusers"``,
            ``"sdnq"`` (SDNQ-quantized layers streamed packed; ``linear`` with ``preset="auto"`` picks it
            for such a module), or ``"nvme"`` (stream from the safetensors files: only through
            ``ddo_blocks.from_pretrained(..., route="nvme")``, which knows the files; a module that is
            already loaded raises ``ConfigError``). ``python -m ddo_blocks presets`` lists them.
        preset: the route's policy; ``"auto"`` chooses.
        vram_budget: bytes or a string such as ``"6GiB"`` for the component's weights on the device
            (activations come on top); ``"min"``: the smallest plan (streaming routes); ``"auto"``: half
            the device's free memory, then what the first call's activations leave, planned with the
            compute each unit measured on the second call (``ddo_blocks.autobudget``; the report's
            ``auto_budget`` section). ``None``: no limit
            (everything resident).
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (the same engine, slots in host memory).
        component: a name for reports, e.g. ``"transformer"``.
        **options: the route's own options (e.g. ``offload_type`` for the diffusers route,
            ``ram_budget`` for the nvme route); a route rejects options it does not know.

    Returns:
        An :class:`OffloadHandle`.

    Raises:
        ConfigError: unknown route or preset, malformed budget, a module with no parameters.
        BudgetError: the budget cannot hold the always-resident weights plus two slots.
        CudaNotAvailableError: ``device="cuda"`` without a usable driver.
        OffloadStateError: the module is already offloaded.
        OffloadMemoryError: out of GPU memory while setting up (the module is restored).
    """
    _check_is_module(module, "offload()")
    _check_not_offloaded(module)
    routes.resolve(route, preset)  # names first: errors list the valid ones
    spec = routes.for_module(route, preset, module)
    _check_keywords(options, spec)
    if spec.places_weights:
        conflict = guards.foreign_offload(module)
        if conflict is not None:
            raise OffloadStateError(f"{type(module).__name__} {conflict}")
    if spec.streams:
        formats.check_streamable(module, spec.name)
    dev = resolve_device(device)
    if spec.option_values is not None:
        spec.option_values(options)
    auto = _auto_budget(module, spec, options, dev) if vram_budget == "auto" else None
    budget = auto.first_bytes if auto is not None else _budget(vram_budget, module, spec, options, dev)
    if next(module.parameters(), None) is None:
        raise ConfigError(
            f"{type(module).__name__} has no parameters: there is nothing to offload; use route='off'"
        )
    options = dict(options)
    loader = options.pop("_loader", None)
    if loader is None:
        _check_not_meta(module)
    elif not spec.reads_files:
        _materialize(module, loader)  # other routes start from an ordinary CPU module
        loader = None
    route_options = dict(options)  # the factory takes its own out of the dict it gets
    chosen, engine = spec.factory(EngineRequest(module, preset, budget, dev, options, loader, component=component or ""))
    engine.attach()
    handle = OffloadHandle(module, engine, route=spec.name, preset=chosen, requested=preset, component=component,
                           vram_budget=budget, device=dev)
    handle._rebuild = (spec, dict(route_options))
    if auto is not None:
        handle._auto_budget(auto, spec, route_options)
    elif hasattr(getattr(engine, "slots", None), "replan_budget") and getattr(engine, "after_entry_call", 0) is None:
        handle._wire_arena()  # Arena("auto"): planned again once with its phase's budget
    elif route_options.get("codec") == "lossless" and spec.codec_reserve is None and hasattr(engine, "after_entry_call"):
        # the linear route's choice (the NVMe route's lossless is its smaller code: the disk is the bound)
        handle._wire_lossless()  # the measured compute weighs the codings again, once
    setattr(module, _ATTR, handle)
    if getattr(engine, "owns_placement", False):
        handle._guard = guards.ConversionGuard(module, dev, lambda: repr(handle))
        handle._guard.install(handle)
    log.info("offloaded %s: route=%s preset=%s (asked %s), vram_budget=%s, on %s in %.2f s", handle.component,
             spec.name, chosen.name, preset, "none" if budget is None else f"{budget} bytes", dev, engine.setup_s)
    return handle


_OFFLOAD_KEYWORDS = ("route", "preset", "vram_budget", "device", "component")


def _check_keywords(options: dict[str, Any], spec: routes.RouteSpec) -> None:
    """Names a keyword neither ``offload()`` nor the route takes (a typo such as ``devcie=``) before
    anything else is looked at, with the closest one that exists."""
    import difflib

    known = (*_OFFLOAD_KEYWORDS, *spec.options)
    unknown = sorted(k for k in options if k not in known and not k.startswith("_"))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = f"its options are {', '.join(spec.options)}" if spec.options else "it takes no options"
        raise ConfigError(
            f"route {spec.name!r} does not take {', '.join(unknown)}{hint}; {what} (and offload() itself takes "
            f"{', '.join(_OFFLOAD_KEYWORDS)})"
        )


def _auto_budget(module: nn.Module, spec: routes.RouteSpec, options: dict[str, Any],
                 dev: torch.device) -> AutoBudget:
    if not spec.streams:
        raise ConfigError(f"vram_budget='auto' picks the budget of a route that streams; route {spec.name!r} does "
                          "not stream: pass bytes, a size such as '6GiB', or None")
    return AutoBudget.at_attach(dev, _route_minimum(module, spec, options, dev), type(module).__name__)


def _route_minimum(module: nn.Module, spec: routes.RouteSpec, options: dict[str, Any], dev: torch.device) -> int:
    """The streaming minimum of ``spec`` with its options: the linear route's landing buffers for a codec,
    or what the route's ``codec_reserve`` says (the NVMe route's staging buffer)."""
    if spec.codec_reserve is None:
        return minimum_budget(module, units=options.get("units", "auto"), codec=options.get("codec", "off"),
                              device=dev)
    from .streaming import plan

    return plan.minimum_budget(module, options.get("units", "auto")) + spec.codec_reserve(module, options, dev)


def _budget(vram_budget: Any, module: nn.Module, spec: routes.RouteSpec, options: dict[str, Any],
            dev: torch.device) -> int | None:
    """Bytes, a size string, ``None``, or ``"min"``: the smallest plan of a streaming route (the
    always-resident weights plus two slots of the largest unit)."""
    if vram_budget != "min":
        return parse_bytes(vram_budget, what="vram_budget")
    if not spec.streams:
        raise ConfigError(f"vram_budget='min' is the smallest plan of a route that streams; route {spec.name!r} "
                          "does not stream: pass bytes, a size such as '6GiB', or None")
    extra = spec.min_extra(module, options) if spec.min_extra is not None else 0
    return _route_minimum(module, spec, options, dev) + extra


def _check_is_module(module: Any, what: str) -> None:
    if isinstance(module, nn.Module):
        return
    if hasattr(module, "components") and isinstance(getattr(module, "components", None), dict):
        named = [n for n, c in module.components.items() if isinstance(c, nn.Module)]
        raise ConfigError(
            f"{what} takes one component (a torch.nn.Module), got the pipeline {type(module).__name__}; pass one "
            f"of its components ({', '.join(f'pipe.{n}' for n in named) or 'none with weights'})"
        )
    raise ConfigError(f"{what} needs a torch.nn.Module, got {type(module).__name__}")


def _check_not_offloaded(module: nn.Module) -> None:
    """Refuses a module that is offloaded, part of an offloaded module, or holds one."""
    existing = getattr(module, _ATTR, None)
    if existing is not None:
        raise OffloadStateError(
            f"{type(module).__name__} is already offloaded ({existing!r}); call .remove() on that handle first"
        )
    unusable = module.__dict__.get(_UNUSABLE_ATTR)
    if unusable is not None:
        raise OffloadStateError(
            f"{type(module).__name__} cannot be offloaded: {unusable}. Load the model again"
        )
    owner = guards.owner_of(module)
    if owner is not None:
        raise OffloadStateError(
            f"{type(module).__name__} is part of a module that is already offloaded ({owner!r}): its weights are "
            "that offload's. Call remove() on that handle first, or offload the whole module once"
        )
    for name, sub in module.named_modules():
        inner = getattr(sub, _ATTR, None) if sub is not module else None
        if inner is not None:
            raise OffloadStateError(
                f"{type(module).__name__} holds {name} ({type(sub).__name__}), which is already offloaded "
                f"({inner!r}); call remove() on that handle first, then offload the whole module"
            )


def _check_not_meta(module: nn.Module) -> None:
    meta = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if meta:
        shown = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
        raise ConfigError(
            f"{type(module).__name__} has {len(meta)} tensors on the meta device ({shown}): it was built without "
            "its weights (init_empty_weights, device='meta') and never loaded, so there is nothing to offload. "
            "Load its weights first (load_state_dict(..., assign=True)), or build and load it in one step with "
            "ddo_blocks.from_pretrained(ModelClass, path, ...)"
        )


def _materialize(module: nn.Module, loader: Any) -> None:
    cpu = torch.device("cpu")
    for p in module.parameters():
        if loader.pending(p):
            loader.materialize(p, cpu)


def minimum_budget(module: nn.Module, *, units: str = "auto", codec: str = "off",
                   device: str | torch.device = "cuda") -> int:
    """The smallest ``vram_budget`` (bytes) the linear route accepts for ``module``: always-resident
    weights plus two slots of the largest unit, at the given unit granularity (``auto``: the lower
    of blocks and their children), plus, with a ``codec`` on a GPU ``device``, its landing buffers
    (on the CPU the codec decodes straight into the slots)."""
    from .streaming import coded, plan

    _check_is_module(module, "minimum_budget()")
    if codec not in coded.CODECS:
        raise ConfigError(f"codec={codec!r} is not a codec; use one of {', '.join(map(repr, coded.CODECS))}")
    dev = torch.device(device) if isinstance(device, str) else device
    return plan.minimum_budget(module, units) + coded.reserve_bytes(module, codec, dev)


def get_handle(module: nn.Module) -> OffloadHandle | None:
    """The active offload of ``module``, if any."""
    return getattr(module, _ATTR, None)


@dataclass(repr=False)
class OffloadResult:
    """What ``enable_offload`` returns, shaped like the original DDO's result."""

    module: nn.Module
    handle: OffloadHandle

    def __repr__(self) -> str:
        return f"OffloadResult({self.handle!r})"  # not the module's whole tree

    def report(self) -> Report:
        """The measured record of this offload, as :meth:`OffloadHandle.report`."""
        return self.handle.report()

    def remove(self) -> None:
        self.handle.remove()


def enable_offload(
    module: nn.Module,
    preset: str = "auto",
    component: str = "transformer",
    *,
    route: str = "linear",
    vram_budget: int | str | None = None,
    device: str | torch.device | None = None,
) -> OffloadResult:
    """The original DDO's entry point: ``enable_offload(transformer, preset="auto",
    component="transformer").module``. The VRAM budget defaults to ``DDO_VRAM_BUDGET`` if set, else
    to ``"auto"`` on a route that streams (the budget picks itself from the free device memory).
    """
    budget = vram_budget if vram_budget is not None else env.size("DDO_VRAM_BUDGET")
    if budget is None and routes.get(route).streams:
        budget = "auto"
    handle = offload(module, route=route, preset=preset, vram_budget=budget,
                     device=device if device is not None else "cuda", component=component)
    return OffloadResult(module=handle.module, handle=handle)
