"""The scheduler of a streamed component, route-agnostic: the hooks on its streamed units and the
wrapped entry points (``forward``, ``encode``, ``decode``), the execution order learned on the first
call, the in-flight queue (cyclic prefetch: when a slot is released the next unit in order, wrapping
into the next call, is fetched into it; misses and reorders), call records, the calibration call,
and the lock that serialises calls into one component.

It knows no host or device side: it asks its :class:`Pipeline` to fetch a unit into a slot, to wait
for it, to bind and to park it.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import OffloadStateError
from ..units import Unit
from . import guards
from .calibrate import Calibration

log = logging.getLogger("ddo_blocks")

_MAX_PENDING_CALLS = 64
_MAX_TRACE = 1 << 16

_ENTRIES: weakref.WeakSet = weakref.WeakSet()
"""Every entry wrapper the schedulers made: told apart by identity, since functools.wraps copies a
marker attribute onto any wrapper a user builds around ours."""

ENTRY_METHODS = ("forward", "encode", "decode")
"""The entry points that start a call (``encode``/``decode``: VAEs); wrapped so order learning and
call timing see every call."""


@dataclass
class CallRecord:
    seconds: float
    h2d_bytes: int
    misses: int
    host_s: float = 0.0
    """The call's time on the host: from entry to return, before the device finished its work (on
    the CPU engine, the call itself). Near ``seconds`` when the host, not the device, sets the pace."""


@dataclass
class SchedulerStats:
    calls: list[CallRecord] = field(default_factory=list)
    misses: int = 0
    reorders: int = 0
    order_changes: int = 0


class Pipeline(Protocol):
    """What the scheduler drives (the streaming engine)."""

    def fetch(self, u: int, slot: int) -> None:
        """Starts the copy of streamed unit ``u`` into ``slot``."""

    def acquire(self, slot: int) -> None:
        """Makes the compute stream wait until ``slot``'s copy arrived."""

    def release(self, slot: int) -> None:
        """Records on the compute stream that ``slot`` was consumed."""

    def bind(self, u: int, slot: int) -> None:
        """Points unit ``u``'s parameters at ``slot``."""

    def park(self, u: int) -> None:
        """Points unit ``u``'s parameters back at the host side."""

    def bytes_moved(self) -> int:
        """Bytes fetched since attach."""

    def call_started(self) -> None:
        """Route checks at the start of a call (the NVMe route: its files are unchanged)."""

    def call_finished(self) -> None:
        """Route bookkeeping at the end of a call."""

    def entry_call_done(self) -> None:
        """After a call through an entry point has finished (the lock still held, nothing running)."""


def _any_requires_grad(tree: Any) -> bool:
    """Whether any tensor in nested args/kwargs requires grad."""
    if isinstance(tree, torch.Tensor):
        return tree.requires_grad
    if isinstance(tree, (list, tuple)):
        return any(_any_requires_grad(x) for x in tree)
    if isinstance(tree, dict):
        return any(_any_requires_grad(x) for x in tree.values())
    return False


def compute_stream(device: torch.device) -> Callable[[], int]:
    """The handle of ``device``'s current stream, as a function (called several times a call: the
    raw handle from torch skips building a ``torch.cuda.Stream``, 5-25 us apiece on the H200's host)."""
    if device.type == "cuda":
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None and device.index is not None:
            index = device.index
            return lambda: raw(index)
        return lambda: torch.cuda.current_stream(device).cuda_stream
    return lambda: 0


class Scheduler:
    """Runs one component's streamed units through its slots, call after call.

    One call at a time: a second thread calling the component waits for the first call to finish
    (the slots, the schedule and the transport are the component's, not the call's).
    """

    def __init__(self, module: nn.Module, device: torch.device, streamed: list[Unit], resident_units: list[Unit],
                 pipeline: Pipeline):
        self.module = module
        self.device = device
        self.streamed = streamed
        self.resident_units = resident_units
        self.pipeline = pipeline
        self.stats = SchedulerStats()
        self.lock = threading.RLock()  # per component; re-entrant for nested entry points
        self.depth = 0
        self.active = False
        self._solo: int | None = None  # the streamed unit called on its own (outside an entry point), if any
        self._owner: int | None = None  # the thread running a call or a solo unit (it holds the lock)
        self.last_call_clean = False
        """Whether the last call that ended was an entry call that returned (not a unit on its own, not
        interrupted): what a measurement of a whole call may trust."""
        self._hooks: list[Any] = []
        self._wrapped: list[tuple[str, Any, Any]] = []
        self.sched: list[int] = list(range(len(streamed)))
        self._sched_pos: dict[int, int] = {u: i for i, u in enumerate(self.sched)}
        self._next = 0
        self._inflight: collections.deque[tuple[int, int]] = collections.deque()
        self._free: collections.deque[int] = collections.deque()
        self._running: tuple[int, int] | None = None
        self._trace: list[int] = []
        self._call_t0 = 0.0
        self._call_event: Any = None
        self._call_bytes0 = 0
        self._call_misses0 = 0
        self._pending_cuda_calls: list[tuple[Any, Any, int, int, float]] = []
        self._calls_started = 0
        self.calibration: Calibration | None = None
        self._calibrating = False
        self._suspended = False
        self.graph: Any = None
        """The component's ``graph.GraphRunner`` (``graph=True``): entry calls go through it."""
        self.modules: list[nn.Module] | None = None
        """The component's modules, listed at install (a list walks ten times faster than the tree)."""
        self.tree: int | None = None
        """The module tree's identity hash at the last scan (``check_tree``)."""
        self.hook_scan: guards.HookScan | None = None
        """Every call looks for hooks installed on those modules through it (``guards.HookScan``)."""

    # ---------------------------------------------------------------------------------------------
    # installing and removing
    # ---------------------------------------------------------------------------------------------
    def start(self, n_slots: int) -> None:
        """Frees every slot and fetches the first units of the first call."""
        self._free = collections.deque(range(n_slots))
        self.active = True
        self.topup()

    def install(self) -> None:
        self.modules = list(self.module.modules())
        self.hook_scan = guards.HookScan(self.module, self.modules)
        for u, unit in enumerate(self.streamed):
            self._hooks.append(unit.module.register_forward_pre_hook(self._make_pre(u), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(self._make_post(u), always_call=True))
        # Calls are delimited by wrapping the entry points on the instance, with try/finally: torch's
        # always_call hooks do not run on KeyboardInterrupt, which would leave the call open forever.
        for name in ENTRY_METHODS:
            previous = self.module.__dict__.get(name)
            method = getattr(self.module, name, None)
            if not callable(method):
                continue
            while method in _ENTRIES:  # a stale wrapper of an earlier offload (not a user's wrapper of it)
                method = method.__wrapped__
            wrapper = self._wrap_entry(method)
            setattr(self.module, name, wrapper)
            self._wrapped.append((name, wrapper, previous))

    def rehook(self, u: int, module: nn.Module) -> None:
        """Streamed unit ``u`` runs as ``module`` from now on (its own module left the tree and this one
        holds its parameters): its hooks move there."""
        for h in self._hooks[2 * u: 2 * u + 2]:
            h.remove()
        self._hooks[2 * u] = module.register_forward_pre_hook(self._make_pre(u), with_kwargs=True)
        self._hooks[2 * u + 1] = module.register_forward_hook(self._make_post(u), always_call=True)

    def refresh_modules(self) -> None:
        """The module tree changed (a layer added or swapped): the per-call hook scan walks the new one."""
        self.modules = list(self.module.modules())
        self.hook_scan = guards.HookScan(self.module, self.modules)

    def uninstall(self) -> None:
        """Removes the hooks and entry wrappers; safe on a partial install."""
        self.active = False
        if self.graph is not None:
            self.graph.close()
            self.graph = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for name, wrapper, previous in self._wrapped:
            if self.module.__dict__.get(name) is wrapper:  # else someone wrapped on top: ours goes transparent
                if previous is None:
                    self.module.__dict__.pop(name, None)
                else:
                    self.module.__dict__[name] = previous
        self._wrapped.clear()
        self._running = None
        self._inflight.clear()

    def _wrap_entry(self, method: Callable[..., Any]) -> Callable[..., Any]:
        sched = self

        @functools.wraps(method)  # keeps the signature visible (pipelines inspect forward's parameters)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if not sched.active:  # left behind under another wrapper after remove(): transparent
                return method(*args, **kwargs)
            with sched.lock:
                if not sched.active:  # removed while this thread waited for the lock
                    return method(*args, **kwargs)
                try:
                    return sched.dispatch(method, args, kwargs)
                except torch.OutOfMemoryError as exc:
                    on_oom = getattr(sched.pipeline, "on_oom", None) if sched.depth == 0 else None
                    if on_oom is not None:  # vram_budget="auto" before its first call returned
                        try:
                            on_oom(exc)  # attaches smaller for the next call, and says so on the error
                        except Exception as other:  # noqa: BLE001 - the call's own error is the one to see
                            exc.add_note(f"ddo_blocks: attaching smaller after it failed too "
                                         f"({type(other).__name__}: {other})")
                    raise

        _ENTRIES.add(entry)
        return entry

    def dispatch(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One call through an entry point, the lock held: a graph replay where the runner takes it."""
        if self.graph is not None and self.depth == 0:
            return self.graph.call(method, args, kwargs)
        return self.eager_call(method, args, kwargs)

    def eager_call(self, method: Callable[..., Any], args: tuple, kwargs: dict, capturing: bool = False) -> Any:
        """One call through an entry point, its units' hooks running (``capturing``: inside a CUDA
        graph capture, which records no timing events)."""
        self.enter(capturing)
        clean = False
        try:
            out = method(*args, **kwargs)
            clean = True
            return out
        finally:
            self.exit(clean, capturing)

    # ---------------------------------------------------------------------------------------------
    # the in-flight queue
    # ---------------------------------------------------------------------------------------------
    def suspend(self) -> None:
        """Forgets the prefetched units (their slots are about to lose their memory, between calls);
        nothing is fetched until :meth:`resume`, and the next call starts from the first unit."""
        self._drop_inflight()
        self._next = 0
        self._suspended = True

    def resume(self) -> None:
        self._suspended = False
        self.topup()

    def topup(self) -> None:
        if not self.sched or self._suspended:
            return
        while self._free:
            u = self.sched[self._next]
            slot = self._free.popleft()
            try:
                self.pipeline.fetch(u, slot)
            except BaseException:
                self._free.appendleft(slot)  # a failed fetch keeps its slot (the next topup retries it)
                raise
            self._next = (self._next + 1) % len(self.sched)
            self._inflight.append((u, slot))

    def refetch(self, units: set[int]) -> None:
        """Fetches the prefetched units among ``units`` again, into the same slots (their host copy was
        edited since they were fetched): the in-flight state stays as it was."""
        for u, slot in self._inflight:
            if u in units:
                self.pipeline.fetch(u, slot)

    def _take_inflight(self, u: int) -> int | None:
        """The slot of unit ``u`` if it is already in flight further down the queue."""
        for i, (v, slot) in enumerate(self._inflight):
            if v == u:
                del self._inflight[i]
                return slot
        return None

    def _drop_inflight(self) -> None:
        while self._inflight:
            self._free.append(self._inflight.popleft()[1])

    def inflight_state(self) -> tuple:
        """The in-flight ``(unit, slot)`` pairs, the next unit to fetch, the free slots: what a graph
        replay starts from and ends in."""
        return tuple(self._inflight), self._next, tuple(self._free)

    def set_inflight(self, state: tuple) -> None:
        """Sets the in-flight state a graph replay ended in (no hook ran to move it there)."""
        inflight, nxt, free = state
        self._inflight = collections.deque(inflight)
        self._next = nxt
        self._free = collections.deque(free)

    def restore_slots(self, state: tuple) -> None:
        """After a CUDA graph capture (finished or failed), which ran none of the copies it queued: every
        unit parked, nothing running, the in-flight state the device still holds."""
        self._running = None
        for u in range(len(self.streamed)):
            self.pipeline.park(u)
        self.set_inflight(state)

    def _make_pre(self, u: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            me = threading.get_ident()
            if self.active and self._owner != me:
                # the unit is called on its own, outside the component's entry points (vae.decoder(...),
                # a block called by hand), or from a thread that is not running this component's call:
                # it takes the lock (waiting for another thread's call) and the route's per-call checks
                # too; the post-hook (always called, even when this one raises) gives them back
                self.lock.acquire()
                self._solo, self._owner = u, me
                self.pipeline.call_started()
            if torch.is_grad_enabled() and (_any_requires_grad((args, kwargs))
                                            or any(p.requires_grad for _, p in self.streamed[u].params)):
                self._refuse_backward(u)
            self.unit_start(u)

        return pre

    def _refuse_backward(self, u: int) -> None:
        raise OffloadStateError(
            f"{type(self.module).__name__} is offloaded for inference, but autograd is on and the input of its "
            f"streamed unit {self.streamed[u].name!r} requires grad (an input that requires grad, a trainable "
            "layer before it, or the unit's own parameters): backward would read that unit's weights from a slot that later units have "
            "overwritten, and give wrong gradients. Run it under torch.no_grad() or torch.inference_mode(), "
            "detach the input, or keep the component resident (route='resident') to take gradients"
        )

    def _make_post(self, u: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            try:
                self.unit_end(u)
            finally:
                if self._solo == u and self._owner == threading.get_ident():
                    self._solo = self._owner = None
                    self.last_call_clean = False
                    try:
                        self.pipeline.call_finished()
                    finally:
                        self.lock.release()

        return post

    def unit_start(self, u: int) -> None:
        if self._running is not None:  # the previous unit raised or units nest: settle it first
            self.unit_end(self._running[0])
        if len(self._trace) < _MAX_TRACE:  # units run outside any call (e.g. vae.decoder(...)) must not grow it
            self._trace.append(u)
        missed = False
        if self._inflight and self._inflight[0][0] == u:
            _, slot = self._inflight.popleft()
        elif (taken := self._take_inflight(u)) is not None:
            slot = taken  # prefetched, just not next (e.g. attention before the projection it was defined after)
            self.stats.reorders += 1
        else:
            self.stats.misses += 1
            self._drop_inflight()
            pos = self._sched_pos.get(u)
            if pos is not None:
                self._next = (pos + 1) % len(self.sched)
            slot = self._free.popleft()
            missed = True
        cal = self.calibration if self._calibrating else None
        try:
            if missed:
                self.pipeline.fetch(u, slot)
            if cal is not None:
                cal.before_wait(self.streamed[u].index)
            self.pipeline.acquire(slot)
        except BaseException:
            self._free.append(slot)  # keep the slot usable: the error itself is what the caller sees
            raise
        if cal is not None:
            cal.unit_begin(self.streamed[u].index)
        self.pipeline.bind(u, slot)
        self._running = (u, slot)
        self.topup()

    def unit_end(self, u: int) -> None:
        if self._running is None or self._running[0] != u:
            return
        slot = self._running[1]
        self._running = None
        if self._calibrating:
            self.calibration.unit_end(self.streamed[u].index)
        self.pipeline.release(slot)
        self.pipeline.park(u)
        self._free.append(slot)
        self.topup()

    # ---------------------------------------------------------------------------------------------
    # calls
    # ---------------------------------------------------------------------------------------------
    def check_call(self) -> None:
        """The checks at the start of every call: inference only, no offloading on top."""
        self.check_grad()
        self.refuse_on_top(self.check_tree(on_top=True))

    def check_tree(self, on_top: bool = False) -> Any:
        """Scans the module tree's hooks (``guards.HookScan``), keeping its identity hash in ``tree``;
        returns that hash, or (``on_top``) the offloading installed on top, if any."""
        (_, _, self.tree), (found, _) = self.hook_scan.scan()
        return found if on_top else self.tree

    def check_grad(self) -> None:
        if torch.is_grad_enabled() and any(p.requires_grad for u in self.streamed for _, p in u.params):
            raise OffloadStateError(
                f"{type(self.module).__name__} is offloaded for inference, but autograd is on and its streamed "
                "parameters require grad: backward would read weights from slots the next units reuse. Run it "
                "under torch.no_grad() or torch.inference_mode(), or call module.requires_grad_(False)"
            )

    def refuse_on_top(self, on_top: str | None) -> None:
        if on_top is not None:
            raise OffloadStateError(
                f"{type(self.module).__name__} is offloaded by ddo_blocks, and {on_top} was applied on top: "
                "the two would move the same weights. Remove the other offloading, or call remove() on "
                "the ddo_blocks handle (it restores the weights) and apply only one of them"
            )

    def enter(self, capturing: bool = False) -> None:
        if self.depth == 0:
            self.check_call()
        self.depth += 1
        if self.depth > 1:
            return
        self._owner = threading.get_ident()  # its units' hooks run in this thread without taking the lock again
        try:
            self.pipeline.call_started()
        except BaseException:
            self.depth -= 1
            self._owner = None
            raise
        if self._running is not None and self.streamed[self._running[0]].module is not self.module:
            self.unit_end(self._running[0])  # left open by an interrupted call (the root may be a unit)
        self._trace = []
        if self.calibration is None and self._calls_started == 1 and self.streamed:
            self.calibration = Calibration(self.device, [(u.index, u.module) for u in self.resident_units])
            self._calibrating = True
        if not capturing:  # its replay counts it
            self._calls_started += 1
        self._call_misses0 = self.stats.misses
        self._call_bytes0 = self.pipeline.bytes_moved()
        if self.device.type == "cuda" and not capturing:
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
            self._call_event = start
        self._call_t0 = time.perf_counter()

    def exit(self, clean: bool = True, capturing: bool = False) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        if self._solo is None:  # a root that is itself a unit: its post-hook still has to give the lock back
            self._owner = None
        self.last_call_clean = clean
        if self._running is not None:
            self.unit_end(self._running[0])
        if self._calibrating:
            self.calibration.close()
            self._calibrating = False
        nbytes = self.pipeline.bytes_moved() - self._call_bytes0
        misses = self.stats.misses - self._call_misses0
        host_s = time.perf_counter() - self._call_t0
        if capturing:
            pass  # a capture runs nothing: its replay is the call that gets a record
        elif self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._record_cuda_call(self._call_event, end, nbytes, misses, host_s)
        else:
            self.stats.calls.append(CallRecord(host_s, nbytes, misses, host_s))
        if clean and self._trace and self._trace != self.sched:
            # Learn the confirmed execution order; refetch the start of the next call in it.
            self.stats.order_changes += 1
            log.debug("%s: execution order learned from call %d (%d streamed units, change %d)",
                      type(self.module).__name__, self._calls_started, len(self._trace), self.stats.order_changes)
            self.sched = list(self._trace)
            self._sched_pos = {}
            for i, v in enumerate(self.sched):
                self._sched_pos.setdefault(v, i)
            self._drop_inflight()
            self._next = 0
            self.topup()
        self.pipeline.call_finished()
        self.pipeline.entry_call_done()

    def _record_cuda_call(self, start: Any, end: Any, nbytes: int, misses: int, host_s: float) -> None:
        self._pending_cuda_calls.append((start, end, nbytes, misses, host_s))
        if len(self._pending_cuda_calls) > _MAX_PENDING_CALLS:  # long done: resolving waits for nothing
            self._resolve_calls(self._pending_cuda_calls[: -_MAX_PENDING_CALLS // 2])
            del self._pending_cuda_calls[: -_MAX_PENDING_CALLS // 2]

    def record_replay(self, start: Any, end: Any, nbytes: int, host_s: float) -> None:
        """The record of a call that was a graph replay (CUDA events around it; ``None`` on the CPU)."""
        self._calls_started += 1
        self.last_call_clean = True
        if start is not None:
            self._record_cuda_call(start, end, nbytes, 0, host_s)
        else:
            self.stats.calls.append(CallRecord(host_s, nbytes, 0, host_s))

    def _resolve_calls(self, pending: list[tuple[Any, Any, int, int, float]]) -> None:
        for start, end, nbytes, misses, host_s in pending:
            end.synchronize()
            self.stats.calls.append(CallRecord(start.elapsed_time(end) / 1e3, nbytes, misses, host_s))

    def call_records(self) -> list[CallRecord]:
        """Per-call timings (CUDA calls are resolved here, which waits for them to finish)."""
        self._resolve_calls(self._pending_cuda_calls)
        self._pending_cuda_calls.clear()
        return self.stats.calls
