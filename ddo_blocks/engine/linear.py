"""The linear route's streaming engine.

Per component: units in confirmed execution order; a static resident set and K slots from the
planner; streamed units packed into host slabs; K slots of the largest streamed unit allocated once
through PyTorch, with the (unit, slot) tensor views built once; copies on a side stream ordered by
events (``_native.Transport``), never a device-wide synchronisation; cyclic prefetch: when a slot
is released the next unit in execution order (wrapping into the next call) is fetched into it.

The same engine runs with ``device="cpu"``: slots live in ordinary memory and copies are memcpy,
so planning, slot binding, hooks and exactness are all exercised without a GPU.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _native
from ..errors import BudgetError, ConfigError, DdoError, OffloadMemoryError, OffloadStateError
from ..presets import HostMode, Preset
from ..units import GRANULARITIES, Unit, geometry, span_nbytes, split_units, strided_view, tensor_nbytes
from . import bandwidth, guards
from .calibrate import Calibration
from .slabs import SlabSet
from .upload import STAGING_BYTES, copy_from_host, staged_upload

_MAX_PENDING_CALLS = 64
_MAX_TRACE = 1 << 16

ENTRY_METHODS = ("forward", "encode", "decode")
"""The entry points that start a call (``encode``/``decode``: VAEs); wrapped so order learning and
call timing see every call."""


@dataclass
class CallRecord:
    seconds: float
    h2d_bytes: int
    misses: int


@dataclass
class EngineStats:
    setup_s: float = 0.0
    pack_s: float = 0.0
    calls: list[CallRecord] = field(default_factory=list)
    misses: int = 0
    reorders: int = 0
    order_changes: int = 0


def _any_requires_grad(tree: Any) -> bool:
    """Whether any tensor in nested args/kwargs requires grad."""
    if isinstance(tree, torch.Tensor):
        return tree.requires_grad
    if isinstance(tree, (list, tuple)):
        return any(_any_requires_grad(x) for x in tree)
    if isinstance(tree, dict):
        return any(_any_requires_grad(x) for x in tree.values())
    return False


def _streams_for(device: torch.device) -> tuple[Any, Callable[[], int]]:
    if device.type == "cuda":
        copy_stream = torch.cuda.Stream(device)
        return copy_stream, lambda: torch.cuda.current_stream(device).cuda_stream
    return None, lambda: 0


class LinearEngine:
    """Streams one component's units through K device slots. Created by ``ddo_blocks.offload``.

    One call at a time: a second thread calling the component waits for the first call to finish
    (the slots, the schedule and the transport are the component's, not the call's).
    """

    owns_placement = True
    """Every weight lives where this engine put it: conversions are refused while it is attached."""

    def __init__(self, module: nn.Module, preset: Preset, budget: int | None, device: torch.device,
                 loader: Any = None, units: str = "auto"):
        self.module = module
        self.loader = loader
        """A ``loading.Loader`` when the module was built on the meta device (``from_pretrained``)."""
        self.preset = preset
        self.budget = budget
        self.device = device
        self.buffers = [
            (owner, name, buf)
            for owner in module.modules()
            for name, buf in owner._buffers.items()
            if buf is not None
        ]
        self.link_bytes_per_s = bandwidth.link_bytes_per_s(device)
        if units not in ("auto", *GRANULARITIES):
            raise ConfigError(f"units={units!r} is not a unit granularity; use 'auto', 'block' or 'child'")
        self.granularity, self.units, self.leftovers, self.unit_bytes, self.base_bytes, self.plan = (
            self._choose_units(units)
        )
        self.stats = EngineStats()
        self._orig_device: dict[int, torch.device] = {}
        self._orig_buffers: list[tuple[nn.Module, str, torch.device]] = []
        self.streamed = [u for u, r in zip(self.units, self.plan["resident"]) if not r]
        self.resident_units = [u for u, r in zip(self.units, self.plan["resident"]) if r]
        self.geometry = [[geometry(p) for _, p in u.params] for u in self.streamed]
        """Per streamed unit, its tensors' shapes, strides and dtypes as they were at offload time."""
        self.slabs: SlabSet | None = None
        self.transport: Any = None
        self.slot_storage: torch.Tensor | None = None
        self.slot_views: list[list[list[torch.Tensor]]] = []
        self.slot_bytes = 0
        self.n_slots = 0
        self._hooks: list[Any] = []
        self._wrapped: list[tuple[str, Any, Any]] = []
        self._depth = 0
        self._attached = False
        self._lock = threading.RLock()  # per component; re-entrant for nested entry points
        # pipeline state (indices into self.streamed)
        self.sched: list[int] = list(range(len(self.streamed)))
        self._sched_pos: dict[int, int] = {u: i for i, u in enumerate(self.sched)}
        self._next = 0
        self._inflight: collections.deque[tuple[int, int]] = collections.deque()
        self._free: collections.deque[int] = collections.deque()
        self._running: tuple[int, int] | None = None
        self._trace: list[int] = []
        self._call_t0 = 0.0
        self._call_events: Any = None
        self._call_bytes0 = 0
        self._call_misses0 = 0
        self._pending_cuda_calls: list[tuple[Any, Any, int, int]] = []
        self._final_transport_stats: tuple[int, int, float] = (0, 0, 0.0)
        self._calls_started = 0
        self._calibration: Calibration | None = None
        self._calibrating = False
        self._copy_stream, self._compute_stream = _streams_for(device)

    def _plan(self, granularity: str) -> tuple[str, list[Unit], list, list[int], int, dict]:
        units, leftovers = split_units(self.module, granularity)
        base = sum(tensor_nbytes(p) for _, p in leftovers) + sum(tensor_nbytes(b) for _, _, b in self.buffers)
        sizes = [_native.layout_unit([span_nbytes(p) for _, p in u.params])[1] for u in units]
        plan = _native.plan(
            sizes,
            base_bytes=base,
            budget_bytes=self.budget,
            link_bytes_per_s=self.link_bytes_per_s,
            compute_bytes_per_s=bandwidth.compute_bytes_per_s(self.device, self.link_bytes_per_s),
            min_slots=self.preset.min_slots,
            max_slots=self.preset.max_slots,
        )
        return granularity, units, leftovers, sizes, base, plan

    def _choose_units(self, units: str) -> tuple[str, list[Unit], list, list[int], int, dict]:
        """Blocks as units, unless the budget needs smaller units or the planner predicts a clearly
        faster step with each block's children as units (smaller slots leave more budget resident)."""
        if units != "auto":
            return self._plan(units)
        try:
            block = self._plan("block")
        except BudgetError:
            return self._plan("child")  # its error, if any, names the lower minimum
        if block[5]["slots"] == 0:
            return block  # everything fits: nothing streams
        child = self._plan("child")
        if len(child[1]) > len(block[1]) and child[5]["predicted_step_s"] < 0.97 * block[5]["predicted_step_s"]:
            return child
        return block

    # ---------------------------------------------------------------------------------------------
    # attach / detach
    # ---------------------------------------------------------------------------------------------
    def attach(self) -> None:
        t0 = time.perf_counter()
        for _, p in self.module.named_parameters():
            self._orig_device[id(p)] = p.device
        try:
            self._place_resident()
            tp = time.perf_counter()
            self._build_slabs()
            self.stats.pack_s = time.perf_counter() - tp
            self._build_slots()
            self._install_hooks()
        except Exception as exc:
            self._rollback()
            if isinstance(exc, torch.OutOfMemoryError):
                raise OffloadMemoryError(
                    f"out of GPU memory while setting up the offload of {type(self.module).__name__} "
                    f"(plan needs {self.plan['gpu_bytes']} bytes on {self.device}); the module was "
                    "restored; pass a smaller vram_budget or free GPU memory"
                ) from exc
            raise
        self._attached = True
        self._topup()
        self.stats.setup_s = time.perf_counter() - t0

    def _place_resident(self) -> None:
        dev = self.device
        for owner, name, buf in self.buffers:
            self._orig_buffers.append((owner, name, buf.device))
            if buf.device != dev:
                owner._buffers[name] = buf.to(dev)
        params = [p for _, p in self.leftovers] + [p for u in self.resident_units for _, p in u.params]
        pinned = self.preset.host is HostMode.PINNED_SLABS
        if self.loader is not None:
            pending = [p for p in params if self.loader.pending(p)]
            for p, data in zip(pending, self.loader.materialize_many(pending, dev, pinned=pinned)):
                p.data = data
        if dev.type == "cuda" and pinned:
            # pageable tensor-by-tensor .to() runs at ~8 GB/s: stage through two pinned buffers,
            # pointing each parameter at its GPU copy (freeing the host one) batch by batch. Presets
            # that avoid page-locked memory keep .to(), which frees each host tensor as it goes; so
            # do tensor subclasses without one plain storage (quantized wrappers).
            unique = list({id(p): p for p in params}.values())
            staged = [p for p in unique if type(p.data) is torch.Tensor and p.device.type == "cpu"
                      and p.data.is_contiguous() and 0 < tensor_nbytes(p) <= STAGING_BYTES]

            def point(batch: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
                for p, out in batch:
                    p.data = out

            pairs = [(p, torch.empty_like(p.data, device=dev)) for p in staged]
            staged_upload(pairs, dev, tensor_nbytes, copy_from_host, queued=point)
        for p in params:
            if p.device != dev:
                p.data = p.data.to(dev)

    def _build_slabs(self) -> None:
        if not self.streamed:
            return
        pin = self.device.type == "cuda" and self.preset.host is HostMode.PINNED_SLABS
        ordinal = self.device.index or 0
        self.slabs = SlabSet(self.streamed, pin=pin, ordinal=ordinal, keep_warm=self.preset.keep_warm)
        self.slabs.pack(self.loader)

    def _streamed_layout(self) -> tuple[list[list[int]], list[int]]:
        """Per streamed unit: its tensors' byte offsets in a slot, and its slot bytes."""
        assert self.slabs is not None
        return self.slabs.param_offsets, self.slabs.unit_nbytes

    def _build_slots(self) -> None:
        if not self.streamed:
            return
        self.n_slots = max(1, min(int(self.plan["slots"]), len(self.streamed)))
        param_offsets, unit_nbytes = self._streamed_layout()
        self.slot_bytes = max(unit_nbytes)
        self.slot_storage = torch.empty(self.n_slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self.slot_views = []
        for u in range(len(self.streamed)):
            per_slot = []
            for s in range(self.n_slots):
                base = self.slot_storage[s * self.slot_bytes : (s + 1) * self.slot_bytes]
                per_slot.append([strided_view(base, off, g) for g, off in zip(self.geometry[u], param_offsets[u])])
            self.slot_views.append(per_slot)
        self.transport = self._make_transport()
        self._free = collections.deque(range(self.n_slots))

    def _make_transport(self) -> Any:
        staging = None
        if self.preset.host is HostMode.PAGEABLE_STAGED:
            staging = (
                self.preset.staging_buffers,
                self.preset.staging_buffer_mib * 1024 * 1024,
                self.preset.staging_threads,
                True,
            )
        copy_stream = self._copy_stream.cuda_stream if self._copy_stream is not None else 0
        return _native.Transport(self.device.type, self.device.index or 0, self.n_slots, copy_stream, staging)

    def _install_hooks(self) -> None:
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
            while getattr(method, "_ddo_entry", False):  # a stale wrapper of an earlier offload
                method = method.__wrapped__
            wrapper = self._wrap_entry(method)
            setattr(self.module, name, wrapper)
            self._wrapped.append((name, wrapper, previous))

    def _wrap_entry(self, method: Callable[..., Any]) -> Callable[..., Any]:
        engine = self

        @functools.wraps(method)  # keeps the signature visible (pipelines inspect forward's parameters)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if not engine._attached:  # left behind under another wrapper after remove(): transparent
                return method(*args, **kwargs)
            with engine._lock:
                engine._enter()
                clean = False
                try:
                    out = method(*args, **kwargs)
                    clean = True
                    return out
                finally:
                    engine._exit(clean)

        entry._ddo_entry = True  # type: ignore[attr-defined]
        return entry

    def detach(self) -> None:
        """Restores every parameter and buffer to its original device with its own memory."""
        if not self._lock.acquire(blocking=False):
            raise OffloadStateError(
                f"cannot remove the offload of {type(self.module).__name__} while another thread runs it; "
                "call remove() after that call returns"
            )
        try:
            if self._depth > 0:
                raise OffloadStateError(
                    f"cannot remove the offload of {type(self.module).__name__} while it is running; "
                    "call remove() after the forward (or encode/decode) returns"
                )
            self._rollback()
            self._attached = False
        finally:
            self._lock.release()

    @property
    def attached(self) -> bool:
        """Whether the offload is in place (hooks installed, weights where the engine put them)."""
        return self._attached

    def _rollback(self) -> None:
        """Undoes whatever part of the attach happened. Safe on a partial attach. From its first
        step on the offload is gone (``attached`` is False), even if a later step raises."""
        was_attached, self._attached = self._attached, False
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
        close_error: DdoError | None = None
        if self.transport is not None:
            self._final_transport_stats = self.transport.stats()
            try:
                self.transport.close()  # drains in-flight copies before slots and slabs go
            except DdoError as exc:  # resources are freed anyway: finish restoring, then report it
                close_error = exc
            finally:
                self.transport = None
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self._running is not None:
            self._running = None
        self.slot_views = []
        self.slot_storage = None
        self._inflight.clear()
        if self.slabs is not None:
            self.slabs.release(self._orig_device, keep_warm=self.preset.keep_warm and was_attached)
            self.slabs = None
        for _, p in self.module.named_parameters():
            dev = self._orig_device.get(id(p))
            if dev is not None and p.device != dev:
                p.data = p.data.to(dev)
        for owner, name, dev in self._orig_buffers:
            buf = owner._buffers.get(name)
            if buf is not None and buf.device != dev:
                owner._buffers[name] = buf.to(dev)
        self._orig_buffers.clear()
        if close_error is not None:
            raise close_error

    # ---------------------------------------------------------------------------------------------
    # the pipeline
    # ---------------------------------------------------------------------------------------------
    def _fetch(self, u: int, slot: int) -> None:
        assert self.slabs is not None and self.slot_storage is not None
        dst = self.slot_storage.data_ptr() + slot * self.slot_bytes
        self.transport.fetch(slot, dst, self.slabs.unit_ptr(u), self.slabs.unit_nbytes[u])

    def _topup(self) -> None:
        if not self.sched:
            return
        while self._free:
            u = self.sched[self._next]
            self._next = (self._next + 1) % len(self.sched)
            slot = self._free.popleft()
            self._fetch(u, slot)
            self._inflight.append((u, slot))

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

    def _bind(self, unit: Unit, views: list[torch.Tensor]) -> None:
        for (_, p), v in zip(unit.params, views):
            p.data = v

    def _park(self, u: int) -> None:
        """Points a streamed unit's parameters back at their host copies after it ran."""
        self._bind(self.streamed[u], self.slabs.host_views[u])

    def _make_pre(self, u: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            if torch.is_grad_enabled() and _any_requires_grad((args, kwargs)):
                self._refuse_backward(u)
            self._unit_start(u)

        return pre

    def _refuse_backward(self, u: int) -> None:
        raise OffloadStateError(
            f"{type(self.module).__name__} is offloaded for inference, but autograd is on and the input of its "
            f"streamed unit {self.streamed[u].name!r} requires grad (an input that requires grad, or a trainable "
            "layer before it): backward would read that unit's weights from a slot that later units have "
            "overwritten, and give wrong gradients. Run it under torch.no_grad() or torch.inference_mode(), "
            "detach the input, or keep the component resident (route='resident') to take gradients"
        )

    def _make_post(self, u: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            self._unit_end(u)

        return post

    def _unit_start(self, u: int) -> None:
        if self._running is not None:  # the previous unit raised or units nest: settle it first
            self._unit_end(self._running[0])
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
        cal = self._calibration if self._calibrating else None
        try:
            if missed:
                self._fetch(u, slot)
            if cal is not None:
                cal.before_wait(self.streamed[u].index)
            self.transport.acquire(slot, self._compute_stream())
        except BaseException:
            self._free.append(slot)  # keep the slot usable: the error itself is what the caller sees
            raise
        if cal is not None:
            cal.unit_begin(self.streamed[u].index)
        self._bind(self.streamed[u], self.slot_views[u][slot])
        self._running = (u, slot)
        self._topup()

    def _unit_end(self, u: int) -> None:
        if self._running is None or self._running[0] != u:
            return
        slot = self._running[1]
        self._running = None
        if self._calibrating:
            self._calibration.unit_end(self.streamed[u].index)
        self.transport.release(slot, self._compute_stream())
        self._park(u)
        self._free.append(slot)
        self._topup()

    def _enter(self) -> None:
        if self._depth == 0 and torch.is_grad_enabled() and self._streamed_require_grad():
            raise OffloadStateError(
                f"{type(self.module).__name__} is offloaded for inference, but autograd is on and its streamed "
                "parameters require grad: backward would read weights from slots the next units reuse. Run it "
                "under torch.no_grad() or torch.inference_mode(), or call module.requires_grad_(False)"
            )
        if self._depth == 0:
            on_top = guards.offload_on_top(self.module)
            if on_top is not None:
                raise OffloadStateError(
                    f"{type(self.module).__name__} is offloaded by ddo_blocks, and {on_top} was applied on top: "
                    "the two would move the same weights. Remove the other offloading, or call remove() on "
                    "the ddo_blocks handle (it restores the weights) and apply only one of them"
                )
        self._depth += 1
        if self._depth > 1:
            return
        if self._running is not None and self.streamed[self._running[0]].module is not self.module:
            self._unit_end(self._running[0])  # left open by an interrupted call (the root may be a unit)
        self._trace = []
        if self._calibration is None and self._calls_started == 1 and self.streamed:
            self._calibration = Calibration(self.device, [(u.index, u.module) for u in self.resident_units])
            self._calibrating = True
        self._calls_started += 1
        self._call_misses0 = self.stats.misses
        self._call_bytes0 = self.transport.stats()[1] if self.transport is not None else 0
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(self.device))
            self._call_events = start
        self._call_t0 = time.perf_counter()

    def _streamed_require_grad(self) -> bool:
        return any(p.requires_grad for u in self.streamed for _, p in u.params)

    def _exit(self, clean: bool = True) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        if self._running is not None:
            self._unit_end(self._running[0])
        if self._calibrating:
            self._calibration.close()
            self._calibrating = False
        nbytes = (self.transport.stats()[1] if self.transport is not None else 0) - self._call_bytes0
        misses = self.stats.misses - self._call_misses0
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._pending_cuda_calls.append((self._call_events, end, nbytes, misses))
            if len(self._pending_cuda_calls) > _MAX_PENDING_CALLS:  # long done: resolving waits for nothing
                self._resolve_calls(self._pending_cuda_calls[: -_MAX_PENDING_CALLS // 2])
                del self._pending_cuda_calls[: -_MAX_PENDING_CALLS // 2]
        else:
            self.stats.calls.append(CallRecord(time.perf_counter() - self._call_t0, nbytes, misses))
        if clean and self._trace and self._trace != self.sched:
            # Learn the confirmed execution order; refetch the start of the next call in it.
            self.stats.order_changes += 1
            self.sched = list(self._trace)
            self._sched_pos = {}
            for i, v in enumerate(self.sched):
                self._sched_pos.setdefault(v, i)
            self._drop_inflight()
            self._next = 0
            self._topup()

    def _resolve_calls(self, pending: list[tuple[Any, Any, int, int]]) -> None:
        for start, end, nbytes, misses in pending:
            end.synchronize()
            self.stats.calls.append(CallRecord(start.elapsed_time(end) / 1e3, nbytes, misses))

    def call_records(self) -> list[CallRecord]:
        """Per-call timings (CUDA calls are resolved here, which waits for them to finish)."""
        self._resolve_calls(self._pending_cuda_calls)
        self._pending_cuda_calls.clear()
        return self.stats.calls

    def calibrated_prediction(self) -> dict[str, Any] | None:
        """The simulator's step time with the compute measured on the calibration call (the
        second call), or None before it ran. Waits for that call to finish on the GPU."""
        cal = self._calibration
        if cal is None or cal.end is None:
            return None
        measured = cal.resolve(len(self.units))
        step, wait = self._simulate(measured["unit_compute_s"])
        return {
            "predicted_step_s": step + measured["rest_s"],
            "predicted_wait_s": wait,
            "compute_s": sum(measured["unit_compute_s"]) + measured["rest_s"],
            "measured_wait_s": measured["wait_s"],
            "calibration_call_s": measured["call_s"],
        }

    def _simulate(self, unit_compute_s: list[float]) -> tuple[float, float]:
        """The simulator's steady step and compute wait for this plan with the given compute times."""
        step, _, wait, _ = _native.simulate(
            self.unit_bytes, unit_compute_s, list(self.plan["resident"]), max(self.n_slots, 1),
            self.link_bytes_per_s, 4, *self._disk_sim_args(),
        )
        return step, wait

    def _disk_sim_args(self) -> tuple:
        """Extra simulator arguments for units read from disk (the NVMe route); none here."""
        return ()

    # ---------------------------------------------------------------------------------------------
    @property
    def streamed_bytes(self) -> int:
        return sum(self.unit_bytes[u.index] for u in self.streamed)

    @property
    def resident_bytes(self) -> int:
        return self.base_bytes + sum(self.unit_bytes[u.index] for u in self.resident_units)

    @property
    def gpu_bytes(self) -> int:
        return self.resident_bytes + self.n_slots * self.slot_bytes

    def transport_stats(self) -> tuple[int, int, float]:
        return self.transport.stats() if self.transport is not None else self._final_transport_stats

