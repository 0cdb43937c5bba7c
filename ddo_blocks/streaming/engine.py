"""The streaming engine: one component's units through K device slots, composed of parts.

    StreamingEngine            attach / detach / rollback, the transport, the report's sections
      ├─ UnitPlan  (plan.py)       units, resident set and slot count from the Rust planner
      ├─ Scheduler (scheduler.py)  hooks, entry points, learned order, in-flight queue, calls, lock
      │    └─ GraphRunner (graph.py)   graph=True: steady calls replayed as CUDA graphs
      ├─ UnitStore (stores.py)     host side: HostSlabs (linear) | FileStore + RAM cache (nvme)
      │                             | CodedSlabs (coded.py: linear with codec="fixed" or "tiered")
      └─ TorchSlots (slots.py)     device side: K slots allocated through PyTorch, views built once

Copies run on a side stream ordered by events (``_native.Transport``), never a device-wide
synchronisation. With ``device="cpu"`` slots live in ordinary memory and copies are memcpy, so
planning, binding, hooks and exactness are all exercised without a GPU.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _native
from ..errors import BudgetError, CheckpointError, DdoError, OffloadMemoryError, OffloadStateError
from ..report import roofline_bound
from ..routes.spec import HostMode, Preset, UnitInfo
from ..units import find_unit_modules, geometry, span_nbytes
from . import bandwidth, coded, plan, slabs
from .edits import EditWatch, Key, get_data, set_data
from .scheduler import CallRecord, Scheduler, compute_stream
from .slots import TorchSlots
from .upload import STAGING_BYTES, copy_from_host, staged_upload

MIRROR_ON_CPU = False
"""Give adapters a device copy on the CPU engine too (tests of the GPU's adapter path)."""


def _device_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An adapter's device copy: an ordinary tensor, whatever mode the call that makes it runs in."""
    with torch.inference_mode(False):
        return host.to(device, copy=True)


class StreamingEngine:
    """Streams one component's units through K device slots. Built by the linear, nvme and sdnq routes.

    Args:
        module: the component.
        preset: the route's preset (slots range, host mode, keep-warm, staging ring).
        budget: bytes for the component's weights on the device (``None``: everything resident).
        device: ``cuda[:N]`` or ``cpu``.
        store: builds the host side for this engine (``HostSlabs``, ``FileStore``, ``coded.CodedSlabs``).
        loader: a ``loading.Loader`` when the module was built on the meta device (``from_pretrained``).
        units: ``auto``, ``block`` or ``child``.
        reserve_bytes: device bytes the store needs beside the slots (the codec's landing buffers),
            taken from the budget before planning.
        link_bytes: per unit, the bytes a fetch sends over the link, when the store sends fewer than
            the unit's size (the codec's estimate): the planner schedules with them.
        compute_bytes: per unit, the bytes its compute is estimated from before it is measured, when
            not its size (the sdnq route: its layers' dequantized weights).
        extra_sections: the route's own report fields (the sdnq route: its packed layers).
        measured: what an earlier plan of this module measured (``plan.Measured``,
            ``OffloadHandle.replan``): plan that granularity with those compute times (and link bytes).
        slots: builds the device side for this engine (default ``TorchSlots``; the vmm route's
            ``arena.ArenaSlots``, which also places the resident units).
        reserve_for: what ``reserve_bytes`` is and what else would work, for the errors (default: a
            codec's landing buffers).
        graph: replay steady calls as CUDA graphs (``graph.py``); where the parts cannot
            (:meth:`graph_blocker`), calls run eagerly and the report says why.
        variants: given the calibration call's compute per unit, the plans a measured re-plan weighs
            (a codec's: which units to code, and with ``lossless`` which codec;
            ``coded.measured_variants``); ``None``: the measured compute as it is.
    """

    owns_placement = True
    """Every weight lives where this engine put it: conversions are refused while it is attached."""

    def __init__(self, module: nn.Module, preset: Preset, budget: int | None, device: torch.device, *,
                 store: Callable[[StreamingEngine], Any], loader: Any = None, units: str = "auto",
                 reserve_bytes: int = 0, link_bytes: plan.LinkBytes | None = None,
                 compute_bytes: plan.ComputeBytes | None = None,
                 extra_sections: Callable[[], dict[str, dict[str, Any]]] | None = None,
                 measured: plan.Measured | None = None, slots: Callable[[StreamingEngine], Any] | None = None,
                 reserve_for: tuple[str, str] | None = None, graph: bool = False,
                 variants: Callable[[StreamingEngine, list[float]], list[plan.Measured]] | None = None):
        self.module = module
        self.preset = preset
        self.budget = budget
        self.device = device
        self.loader = loader
        self.link_bytes_per_s = bandwidth.link_bytes_per_s(device)
        self.reserve_bytes = reserve_bytes
        self.measured = measured
        self.variants = variants
        # each codec's landing buffers, read from the module now: once coded, a streamed unit's
        # parameters are one-value placeholders
        self._codec_reserves = ({c: coded.reserve_bytes(module, c, device) for c in ("off", *coded.CODES)}
                                if variants is not None else {})
        self.units_option = units
        self.unit_plan = plan.choose(module, budget, device, self.link_bytes_per_s, preset, units, reserve_bytes,
                                     link_bytes, compute_bytes, measured,
                                     **({"reserve_for": reserve_for} if reserve_for else {}))
        self.plan = self.unit_plan.native
        self.granularity = self.unit_plan.granularity
        self.units = self.unit_plan.units
        self.unit_bytes = self.unit_plan.unit_bytes
        self.streamed = self.unit_plan.streamed
        self.resident_units = self.unit_plan.resident_units
        self.geometry = [[geometry(p) for _, p in u.params] for u in self.streamed]
        """Per streamed unit, its tensors' shapes, strides and dtypes as they were at offload time."""
        layouts = [_native.layout_unit([span_nbytes(g) for g in unit]) for unit in self.geometry]
        self.offsets = [layout.offsets for layout in layouts]
        self.layout_bytes = [layout.nbytes for layout in layouts]
        self.buffers = [(owner, name, buf) for owner in module.modules() for name, buf in owner._buffers.items()
                        if buf is not None]
        self.orig_device: dict[int, torch.device] = {}
        self._orig_buffers: list[tuple[nn.Module, str, torch.device]] = []
        self.slots = slots(self) if slots is not None else TorchSlots(device)
        self.scheduler = Scheduler(module, device, self.streamed, self.resident_units, self)
        self.store = store(self)
        self._extra_sections = extra_sections
        self.transport: Any = None
        self._final_transport_stats: tuple[int, int, float] = (0, 0, 0.0)
        self.setup_s = 0.0
        self.pack_s = 0.0
        self._attached = False
        try:
            self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        except RuntimeError as exc:  # torch.AcceleratorError: the driver has no memory left for a stream
            if "out of memory" not in str(exc):
                raise
            raise OffloadMemoryError(
                f"out of GPU memory on {device} creating the copy stream, before any weight moved: the module is "
                "as it was; free GPU memory (the driver needs some beyond PyTorch's)"
            ) from exc
        self._stream = compute_stream(device)
        self._measured_plan: tuple[Any, dict[str, Any] | None] | None = None
        self.graph_requested = graph
        self.graph_bytes = 0
        """Bytes graph replays moved, less those their captures counted without moving them."""
        self._prewaited: set[int] | None = None
        self.edits: EditWatch | None = None
        """The watch over the weights users may edit while attached (``edits.py``)."""
        self._extras_on = False
        """Whether binding and parking a unit has more to do than point its parameters (set by the watch)."""
        self._tainted = False
        """An offload sharing this one's host copies was removed with an edit of them pending."""
        self._tree: int | None = None
        self._known: set[int] = set()
        self._home: dict[tuple[int, str], nn.Parameter] = {}
        self.adapters: dict[int, nn.Parameter] = {}
        """Parameters added inside streamed units after the attach (a LoRA's layers, by id)."""
        self._mirrors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per adapter parameter whose values are on the host (where peft puts a layer whose base weight
        is parked there): ``(host values, device copy)``, the copy made once and kept."""
        self._extras: dict[int, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}
        """Per streamed unit: its mirrored adapters, pointed at their device copy while the unit runs."""
        self.on_call_start: Callable[[], None] | None = None
        self.after_entry_call: Callable[[], None] | None = None
        """Set by the handle of a ``vram_budget="auto"`` offload: after its first call the activations'
        measurement, after the second the re-plan (and by an ``Arena("auto")`` member's)."""
        self.on_oom: Callable[[BaseException], None] | None = None
        """Set by the handle of a ``vram_budget="auto"`` offload until its first call returns: told of an
        entry call that ran out of device memory, it attaches the component smaller for the next call
        and notes so on the error, which the entry point then raises (``Scheduler``)."""

    # ---------------------------------------------------------------------------------------------
    # attach / detach
    # ---------------------------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether the offload is in place (hooks installed, weights where the engine put them)."""
        return self._attached

    def attach(self) -> None:
        t0 = time.perf_counter()
        for _, p in self.module.named_parameters():
            self.orig_device[id(p)] = p.device
        try:
            self.slots.before_place()
            self._place_resident()
            tp = time.perf_counter()
            if self.streamed:
                self.store.build()
            if self.slots.places_resident:
                self.slots.place_resident(self.resident_units, self.loader)
            self.pack_s = time.perf_counter() - tp
            if self.streamed:
                n_slots = max(1, min(self.plan.slots, len(self.streamed)))
                self.slots.build(n_slots, self.offsets, self.layout_bytes, self.geometry)
                copy_stream = self._copy_stream.cuda_stream if self._copy_stream is not None else 0
                self.transport = self.store.open_transport(n_slots, self.slots.slot_bytes, self.offsets, copy_stream)
            self.scheduler.install()
            self._watch()
        except Exception as exc:
            self._rollback()
            if isinstance(exc, torch.OutOfMemoryError):
                raise OffloadMemoryError(
                    f"out of GPU memory while setting up the offload of {type(self.module).__name__} "
                    f"(plan needs {self.plan.gpu_bytes} bytes on {self.device}); the module was "
                    "restored; pass a smaller vram_budget or free GPU memory"
                ) from exc
            raise
        self._attached = True
        self.scheduler.start(self.slots.n_slots)
        self.slots.ready()  # evictable from here: its first prefetches are queued
        if self.graph_requested:
            from .graph import GraphRunner

            self.scheduler.graph = GraphRunner(self.scheduler, self)
        self.setup_s = time.perf_counter() - t0

    def _place_resident(self) -> None:
        dev = self.device
        for owner, name, buf in self.buffers:
            self._orig_buffers.append((owner, name, buf.device))
            if buf.device != dev:
                owner._buffers[name] = buf.to(dev)
        params = [p for _, p in self.unit_plan.leftovers]
        if not self.slots.places_resident:
            params += [p for u in self.resident_units for _, p in u.params]
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
                      and p.data.is_contiguous() and 0 < p.numel() * p.element_size() <= STAGING_BYTES]

            def point(batch: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
                for p, out in batch:
                    p.data = out

            pairs = [(p, torch.empty_like(p.data, device=dev)) for p in staged]
            staged_upload(pairs, dev, lambda p: p.numel() * p.element_size(), copy_from_host, queued=point)
        for p in params:
            if p.device != dev:
                p.data = p.data.to(dev)
            elif dev.type == "cpu" and slabs.is_live(p):
                # the CPU engine keeps resident weights where they are: one in another offload's host slab
                # (a replica's) gets memory of its own, or the two modules would share it after a removal
                p.data = p.data.clone()

    def detach(self) -> None:
        """Restores every parameter and buffer to its original device with its own memory."""
        if not self.scheduler.lock.acquire(blocking=False):
            raise OffloadStateError(
                f"cannot remove the offload of {type(self.module).__name__} while another thread runs it; "
                "call remove() after that call returns"
            )
        try:
            if self.scheduler.depth > 0:
                raise OffloadStateError(
                    f"cannot remove the offload of {type(self.module).__name__} while it is running; "
                    "call remove() after the forward (or encode/decode) returns"
                )
            self._rollback()
        finally:
            self.scheduler.lock.release()

    def _rollback(self) -> None:
        """Undoes whatever part of the attach happened. Safe on a partial attach. Once the store has
        brought back what only it holds, the offload is gone (``attached`` is False), even if a
        later step raises."""
        watched = self.edits is not None
        if watched and self._attached:  # edits since the last call: into the host copies the removal reads
            self._taint_sharers()
            for kind, i in self.edits.changed():
                if kind == "resident":
                    self.slots.write_back(i)
                elif kind == "streamed":
                    with contextlib.suppress(OffloadStateError):  # another layout: the parameter keeps it
                        self._repark(i)
        self._unwatch()  # the parts below point parameters at their own memory again
        try:
            deferred = self.store.before_release()  # raises to keep the offload in place
        except BaseException:
            if watched:
                self._watch()
            raise
        was_attached, self._attached = self._attached, False
        self.scheduler.uninstall()
        close_error: DdoError | None = None
        if self.transport is not None:
            self.store.closed(self.transport)
            self._final_transport_stats = self.transport.stats()
            try:
                with contextlib.suppress(CheckpointError):  # a failed read: raised by the call that met it
                    self.transport.close()  # drains in-flight copies before slots and slabs go
            except DdoError as exc:  # resources are freed anyway: finish restoring, then report it
                close_error = exc
            finally:
                self.transport = None
        try:
            if self.device.type == "cuda":
                if self.graph_requested:  # graph replays copy and read on the streams they were launched on
                    torch.cuda.synchronize(self.device)
                else:
                    torch.cuda.current_stream(self.device).synchronize()
            self.slots.close()
            # slabs go one at a time; a parameter whose copy-out failed still points into its slab
            # (the memory stays alive through the view), so its values stay right
            self.store.release(self.orig_device, keep_warm=self.preset.keep_warm and was_attached)
        finally:  # whatever failed above, every parameter and buffer goes back to its device
            for _, p in self.module.named_parameters():
                dev = self.orig_device.get(id(p))
                if dev is not None and p.device != dev:
                    p.data = p.data.to(dev)
            for owner, name, dev in self._orig_buffers:
                buf = owner._buffers.get(name)
                if buf is not None and buf.device != dev:
                    owner._buffers[name] = buf.to(dev)
            self._orig_buffers.clear()
        if close_error is not None:
            raise close_error
        if deferred is not None:
            raise deferred

    @property
    def lost(self) -> list[str]:
        """Parameters a failed removal could not restore (the store left NaN placeholders)."""
        return self.store.lost

    # ---------------------------------------------------------------------------------------------
    # what the scheduler drives
    # ---------------------------------------------------------------------------------------------
    def fetch(self, u: int, slot: int) -> None:
        if self._prewaited is not None:
            self._prewaited.discard(slot)  # a new fetch into the slot: its arrival is the capture's
        self.store.fetch(self.transport, u, slot, self.slots.address(slot))

    def acquire(self, slot: int) -> None:
        if self._prewaited is not None and slot in self._prewaited:
            self._prewaited.discard(slot)  # arrived before the capture: waited for outside it
            return
        self.transport.acquire(slot, self._stream())

    def release(self, slot: int) -> None:
        self.transport.release(slot, self._stream())

    def bind(self, u: int, slot: int) -> None:
        self.slots.bind(self.streamed[u], u, slot)
        if self._extras_on:  # placeholders to swap, or adapters' device copies
            if self.edits.placeholder:
                self.edits.bound(("streamed", u))
            for p, _, mirror in self._extras.get(u, ()):
                set_data(p, mirror)

    def park(self, u: int) -> None:
        for (_, p), v in zip(self.streamed[u].params, self.store.host_views(u)):
            set_data(p, v)
        if self._extras_on:
            if self.edits.placeholder:
                self.edits.parked(("streamed", u))
            for p, host, _ in self._extras.get(u, ()):
                set_data(p, host)

    def bytes_moved(self) -> int:
        return (self.transport.stats()[1] if self.transport is not None else 0) + self.graph_bytes

    # ---------------------------------------------------------------------------------------------
    # CUDA graphs (graph.py)
    # ---------------------------------------------------------------------------------------------
    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        return self._copy_stream if self.streamed else None

    def graph_blocker(self) -> str | None:
        """Why this engine's calls cannot be replayed as CUDA graphs (``None``: they can)."""
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device: calls run eagerly"
        if not self.streamed:
            return None
        for part in (self.store, self.slots):
            blocker = getattr(part, "graph_blocker", None)
            why = blocker() if blocker is not None else f"{type(part).__name__} has no CUDA graph support"
            if why is not None:
                return why
        return None

    def begin_capture(self, stream: torch.cuda.Stream | None) -> None:
        """Before a capture on ``stream``: it waits (outside the capture) for the units in flight,
        whose waits the capture then skips (their copies were queued before it began)."""
        inflight = self.scheduler.inflight_state()[0]
        if self.transport is not None and stream is not None:
            for _, slot in inflight:
                self.transport.acquire(slot, stream.cuda_stream)
        self._prewaited = {slot for _, slot in inflight}

    def end_capture(self) -> None:
        """After a capture, finished or failed: the slots' events were last recorded inside it, where
        nothing outside may wait on them; the device is waited for once and every slot's events are
        recorded again on the compute stream."""
        self._prewaited = None
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            finally:
                if self.transport is not None:
                    self.transport.fence_slots(self._stream())

    def before_replay(self, start: tuple) -> None:
        """The launch stream waits for the units a replay starts with (fetched eagerly, or by the
        previous replay: then already met)."""
        if self.transport is not None:
            for _, slot in start[0]:
                self.transport.acquire(slot, self._stream())

    def after_replay(self) -> None:
        """Every slot consumed and arrived after the graph: later fetches and calls wait for it."""
        if self.transport is not None:
            self.transport.fence_slots(self._stream())

    def call_started(self) -> None:
        if self.edits is not None:
            self._settle_edits()
        self.store.call_started(self.transport)
        self.slots.call_started()
        if self.on_call_start is not None:
            self.on_call_start()

    def call_finished(self) -> None:
        self.store.call_finished(self.transport)
        self.slots.call_finished()

    def entry_call_done(self) -> None:
        if self.after_entry_call is not None:
            self.after_entry_call()

    # ---------------------------------------------------------------------------------------------
    # edits users make while attached (edits.py)
    # ---------------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Watches every parameter whose values this engine keeps somewhere else than where it points:
        the streamed units' (a host copy, or placeholders between calls) and the arena's resident ones."""
        groups: list[tuple[Key, list[tuple[str, nn.Parameter]], bool]] = []
        for u, unit in enumerate(self.streamed):
            parked = any(getattr(v, "_ddo_placeholder", False) for v in self.store.host_views(u))
            groups.append((("streamed", u), unit.params, parked))
        for i, params in enumerate(self.slots.edit_groups()):
            groups.append((("resident", i), params, False))
        self._known = {id(t) for t in (*self.module.parameters(), *self.module.buffers())}
        streamed = {id(p) for unit in self.streamed for _, p in unit.params}
        self._home = {(id(m), n): p for unit in self.streamed for m in unit.module.modules()
                      for n, p in m._parameters.items() if p is not None and id(p) in streamed}
        self._tree = self.scheduler.check_tree()
        self._modules_at_attach = {id(m) for m in self.module.modules()}
        self.edits = EditWatch(type(self.module).__name__, groups, self._host_copy,
                               lambda: getattr(self.store, "parked_where", "elsewhere"))
        self._extras_on = bool(self.edits.placeholder)
        for slab in self._slabs():
            slab.engines.add(self)

    def _slabs(self) -> list[Any]:
        slabs = self.store.slabs
        return list(slabs.slabs) if slabs is not None else []

    def _refuse_shared_edits(self) -> None:
        """Host copies shared with another offload (``share_weights`` / ``replica``: the streamed units'
        are shared, what each keeps resident is its own): an edit through either module would change
        both, so it is refused at the next call of each (until both are removed)."""
        if self._tainted:
            raise OffloadStateError(
                f"weights of {type(self.module).__name__} were edited through the offload it shared its host copies "
                "with (ddo_blocks.replica / share_weights), which was removed since: this module may compute with "
                "part of that edit. Call remove() on this handle, then edit, offload and make the replica again"
            )
        shared = [slab for slab in self._slabs() if slab.users > 1]
        if not shared:
            return
        engines = {id(e): e for slab in shared for e in list(slab.engines)}
        edited = [e for e in engines.values() if e.edits is not None and e.edits.pending("streamed")]
        if edited:
            names = " and ".join(sorted({type(e.module).__name__ for e in edited}))
            raise OffloadStateError(
                f"weights of {names} were edited while it shares its host copies with another "
                "offload (ddo_blocks.replica / share_weights): the shared streamed weights and each offload's own "
                "resident copies would disagree. Call remove() on both handles, edit the model, then offload it "
                "and make the replica again"
            )

    def _taint_sharers(self) -> None:
        """Removing this offload while an edit of shared host copies is pending: the others sharing them
        refuse their calls from now on (the edit may have reached their streamed units)."""
        for slab in self._slabs():
            if slab.users > 1:
                engines = [e for e in list(slab.engines) if e is not self and e.edits is not None]
                if self.edits.pending("streamed") or any(e.edits.pending("streamed") for e in engines):
                    for e in engines:
                        e._tainted = True

    def _unwatch(self) -> None:
        if self.edits is not None:
            self.edits.remove()
            self.edits = None
        for p, host, _ in (x for extras in self._extras.values() for x in extras):
            set_data(p, host)  # the adapter keeps its host values after the removal, as peft put it
        self._mirrors, self._extras, self.adapters = {}, {}, {}
        self._extras_on = False

    def resident_edits_pending(self) -> bool:
        """Whether an arena-resident unit was edited since the last call (an eviction writes them back)."""
        return self.edits is not None and self.edits.pending("resident")

    def _host_copy(self, key: Key, j: int) -> torch.Tensor | None:
        """Where an assignment to a watched parameter must also go: its host copy, when the parameter
        points elsewhere now (a streamed unit in its slot, a resident unit in the arena)."""
        kind, i = key
        if kind == "resident":
            return self.slots.host_copy(i, j)
        return self.store.host_views(i)[j]  # (an adapter's assignment never asks: it points at the value)

    def _settle_edits(self) -> None:
        """At a call's start: prefetched copies of edited streamed units are fetched again (their host
        copy has the edit; a parameter pointed at other memory, ``set_``, gives its values to it), arena
        units edited on the device are copied back to their host copy, adapters' device copies are
        refreshed; a change of the module tree is looked at (``_follow_structure``)."""
        assert self.edits is not None
        self._refuse_shared_edits()
        dirty = self.edits.changed()
        if dirty:
            self._apply_edits(dirty)
        tree = self.scheduler.tree
        swapped = [pid for pid in self._mirrors if not self.edits.watches(self.adapters[pid])]
        if swapped:  # torch.utils.swap_tensors (peft's hot-swap to a larger rank) took its watch away
            for pid in swapped:
                self.edits.forget(self.adapters.pop(pid))
                self._mirrors.pop(pid, None)
            self._tree = None
        if tree != self._tree:
            self.scheduler.refresh_modules()
            self._follow_structure()
            self._tree = self.scheduler.check_tree()

    def _apply_edits(self, dirty: set[Key]) -> None:
        """Settles the edited groups: every one is settled even when one is refused (a parameter pointed
        at another layout), which is raised after, and stays to be refused at the next call."""
        refused: OffloadStateError | None = None
        streamed = {i for kind, i in dirty if kind == "streamed"}
        for u in streamed:
            try:
                self._repark(u)
            except OffloadStateError as exc:
                refused = refused or exc
                self.edits.touched.add(("streamed", u))
        if streamed:
            self.scheduler.refetch(streamed)
        for kind, i in dirty:
            if kind == "resident":
                self.slots.write_back(i)
            elif kind == "adapter":
                self._refresh_adapters(i)
        if refused is not None:
            raise refused

    def _refresh_adapters(self, u: int) -> None:
        """Unit ``u``'s adapters' device copies take their host values (edited, or pointed elsewhere)."""
        extras = self._extras.get(u, [])
        for j, (p, host, mirror) in enumerate(extras):
            now = get_data(p)
            if now.data_ptr() != host.data_ptr() or now.shape != host.shape or now.dtype != host.dtype:
                host, mirror = now, _device_copy(now, self.device)
                self._mirrors[id(p)] = (host, mirror)
                extras[j] = (p, host, mirror)
            else:
                with torch.inference_mode(False), torch.no_grad():
                    mirror.copy_(host)

    def _repark(self, u: int) -> None:
        """An edited streamed unit's parameters all point at their host copy again: one pointed at other
        memory (``p.set_(t)``) gives its values to the host copy first."""
        if u in self.edits.placeholder:
            return  # its parameters refuse every change between calls
        with torch.no_grad():
            for (name, p), host in zip(self.streamed[u].params, self.store.host_views(u)):
                now = get_data(p)
                if now.data_ptr() == host.data_ptr() and now.stride() == host.stride():
                    continue
                if now.shape != host.shape or now.dtype != host.dtype or type(now) is not torch.Tensor:
                    raise OffloadStateError(
                        f"{name} of {type(self.module).__name__} was pointed at a {tuple(now.shape)} {now.dtype} "
                        f"tensor while offloaded as {tuple(host.shape)} {host.dtype}: its slot and host copy hold "
                        "that layout only. Call remove() on the handle, change the module, and offload it again"
                    )
                host.copy_(now)
                set_data(p, host)

    def _follow_structure(self) -> None:
        """The module tree changed since the last call: tensors added inside streamed units (a LoRA's
        layers, a DoRA magnitude) are adapters (``_set_adapters``); a new module around a unit's module
        takes its hooks; a unit whose module left the tree while another module holds its parameters
        (peft's unload of a LoRA loaded before the offload puts the base layer back in the LoRA layer's
        place) follows them to that module; a streamed parameter replaced by another, or held by a module
        outside its unit otherwise, is refused."""
        owner = {id(p): u for u, unit in enumerate(self.streamed) for _, p in unit.params}
        unit_of = {id(unit.module): u for u, unit in enumerate(self.streamed)}
        component = type(self.module).__name__
        seen: set[int] = set()
        strays: dict[int, list[tuple[str, nn.Module, str | None]]] = {}
        found: dict[int, tuple[int, str, nn.Parameter]] = {}
        for m in self.module.modules():
            # a new module around a unit's module (peft's LoRA layer around a Linear that is a unit):
            # the unit runs as the wrapper from now on, its adapters inside it
            if id(m) in self._modules_at_attach or id(m) in unit_of:
                continue
            inner = [unit_of[id(c)] for c in m._modules.values() if c is not None and id(c) in unit_of]
            if len(inner) == 1:
                u = inner[0]
                self.scheduler.rehook(u, m)
                del unit_of[id(self.streamed[u].module)]
                self.streamed[u].module = m
                unit_of[id(m)] = u

        def walk(m: nn.Module, name: str, inside: int | None) -> None:
            seen.add(id(m))
            inside = unit_of.get(id(m), inside)
            for n, p in m._parameters.items():
                if p is None:
                    continue
                was = self._home.get((id(m), n))
                where = f"{name}.{n}" if name else n
                if was is not None and was is not p:
                    raise OffloadStateError(
                        f"{where} of {component} was replaced by a new parameter after the offload (module.weight ="
                        " nn.Parameter(...), load_state_dict(assign=True)), and its unit streams from the old one's "
                        "host copy. Edit the parameter in place instead (weight.data.copy_(...), load_state_dict "
                        "without assign), or call remove() on the handle, change the module, and offload it again"
                    )
                u = owner.get(id(p))
                if u is not None and u != inside:
                    strays.setdefault(u, []).append((where, m, name or None))
                if u is None and inside is not None and id(p) not in self._known:
                    found.setdefault(id(p), (inside, where, p))
            for n, b in m._buffers.items():
                if b is not None and inside is not None and id(b) not in self._known:
                    if b.device != self.device:
                        m._buffers[n] = b = b.to(self.device)
                    self._known.add(id(b))
            for n, c in m._modules.items():
                if c is not None:
                    walk(c, f"{name}.{n}" if name else n, inside)

        walk(self.module, "", None)
        self._set_adapters(found)
        for u, held in strays.items():
            holders = {id(m): m for _, m, _ in held}
            unit = self.streamed[u]
            if id(unit.module) not in seen and len(holders) == 1:
                holder = next(iter(holders.values()))
                self.scheduler.rehook(u, holder)
                self.streamed[u].module = holder
                continue
            where, m, name = held[0]
            raise OffloadStateError(
                f"{where} of {component} streams with unit {unit.name!r}, but the module that holds it now, "
                f"{name or type(m).__name__!r}, runs outside that unit (a layer moved or swapped after the "
                "offload): it would run without its weights. Call remove() on the handle and offload the module "
                "again"
            )

    def _set_adapters(self, found: dict[int, tuple[int, str, nn.Parameter]]) -> None:
        """The adapters now in the streamed units (``found``: by id, with their unit and name): new ones
        are watched and, where their values are on the host and the unit computes on a GPU, get a device
        copy their unit points them at while it runs (switching adapters or strengths moves no base
        bytes, and peft's fuse computes on the host as the base weight does); gone ones are forgotten."""
        assert self.edits is not None
        for pid in [pid for pid in self.adapters if pid not in found]:  # unloaded or deleted
            self.edits.forget(self.adapters.pop(pid))
            self._mirrors.pop(pid, None)
        extras: dict[int, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}
        for pid, (u, name, p) in found.items():
            if pid not in self.adapters:
                self.adapters[pid] = p
                host = get_data(p)
                if host.is_inference():  # no version counter to see an edit by: its only copy, on the device
                    if host.device != self.device:
                        with torch.inference_mode():
                            set_data(p, host.to(self.device))
                elif host.device != self.device or MIRROR_ON_CPU:
                    self._mirrors[pid] = (host, _device_copy(host, self.device))
                self.edits.add(("adapter", u), name, p)
            if pid in self._mirrors:
                extras.setdefault(u, []).append((p, *self._mirrors[pid]))
        self._extras = extras
        self._extras_on = bool(extras) or bool(self.edits.placeholder)

    # ---------------------------------------------------------------------------------------------
    # figures
    # ---------------------------------------------------------------------------------------------
    def call_records(self) -> list[CallRecord]:
        """Per-call timings (CUDA calls are resolved here, which waits for them to finish)."""
        return self.scheduler.call_records()

    def calibrated_prediction(self) -> dict[str, Any] | None:
        """The simulator's step time with the compute measured on the calibration call (the
        second call), or None before it ran. Waits for that call to finish on the GPU."""
        cal = self.scheduler.calibration
        if cal is None or cal.end is None:
            return None
        measured = cal.resolve(len(self.units))
        step, wait = plan.simulate(self.unit_plan, measured["unit_compute_s"], self.slots.n_slots,
                                   self.link_bytes_per_s, self.store.sim_args())
        return {
            "predicted_step_s": step + measured["rest_s"],
            "predicted_wait_s": wait,
            "compute_s": sum(measured["unit_compute_s"]) + measured["rest_s"],
            "measured_wait_s": measured["wait_s"],
            "calibration_call_s": measured["call_s"],
        }

    def measured_plan(self) -> dict[str, Any] | None:
        """The plan the planner would choose with the compute measured on the calibration call (same
        granularity, same budget), against the current plan under the same measurement: what
        ``OffloadHandle.replan`` would attach. A store with a codec offers variants that code fewer
        units (``variants``: each unit's link bytes and compute with or without its decode; with
        ``lossless`` other codecs too), so a compute-bound model can drop the decode it does not need. ``None`` before the
        calibration ran, without streamed units, for a store with a disk (its simulation is the
        RAM cache's), or when the calibration call did not run every unit to its end."""
        cal = self._usable_calibration()
        if cal is None:
            return None
        if self._measured_plan is not None and self._measured_plan[0] is cal:
            return self._measured_plan[1]  # one calibration per engine: planned once
        self._measured_plan = (cal, self._plan_measured(cal))
        return self._measured_plan[1]

    def measured_for(self, budget: int | None) -> plan.Measured | None:
        """What the calibration call measured, as the planner's input for a plan of this module at
        another ``budget`` (``vram_budget="auto"``: the budget grown after the first call); with a
        codec, the variant predicted fastest at that budget. With ``units="auto"`` and child units,
        the blocks' compute (the sum of their children's) is planned too, and blocks are chosen unless
        children predict a step 3 % faster, as ``plan.choose`` does with its prior. ``None`` when
        ``measured_plan`` would be (no calibration yet, nothing streamed, a store with a disk), and
        when the calibration call did not run every unit to its end (another entry point, an error)."""
        cal = self._usable_calibration()
        if cal is None:
            return None
        measured = cal.resolve(len(self.units))
        best = self._best_variant(measured, budget)
        if best is None:
            return None
        block = self._block_variant(measured["unit_compute_s"], budget)
        if block is not None and not best[0] < plan.CHILD_GAIN * block[0]:
            return block[1]
        return best[2]

    def _usable_calibration(self) -> Any:
        """The calibration call, if there is one to plan with: it ran, units stream, the store has no
        disk (its simulation is the RAM cache's), and it ran every unit to its end (a call through
        another entry point, or an interrupted one, would plan the others as free of compute)."""
        cal = self.scheduler.calibration
        if cal is None or cal.end is None or not self.streamed or self.store.sim_args():
            return None
        return cal if cal.covers([u.index for u in self.units]) else None

    def _native_plan(self, unit_bytes: list[int], budget: int | None, unit_compute_s: list[float],
                     link_bytes: list[int] | None = None, reserve: int | None = None) -> Any:
        """``_native.plan`` with this engine's base, link and preset, at ``budget`` less ``reserve``
        (default: this engine's)."""
        reserve = self.reserve_bytes if reserve is None else reserve
        if budget is not None and budget <= reserve:
            raise BudgetError(f"the budget does not hold the {reserve} bytes of landing buffers")
        return _native.plan(
            unit_bytes, base_bytes=self.unit_plan.base_bytes,
            budget_bytes=None if budget is None else budget - reserve,
            link_bytes_per_s=self.link_bytes_per_s,
            compute_bytes_per_s=bandwidth.compute_bytes_per_s(self.device, self.link_bytes_per_s),
            min_slots=self.preset.min_slots, max_slots=self.preset.max_slots,
            unit_compute_s=unit_compute_s, link_bytes=link_bytes)

    def _block_variant(self, unit_compute_s: list[float], budget: int | None) -> tuple[float, plan.Measured] | None:
        """Child units measured, ``units="auto"``, no codec: each block's compute as the sum of its
        children's, planned at ``budget``: ``(predicted step, Measured)``, or ``None`` (not child units,
        a codec's variants, a block without a measured child, or no plan fits)."""
        if self.granularity != "child" or self.units_option != "auto" or self.variants is not None:
            return None
        blocks = [name for name, _ in find_unit_modules(self.module, "block")]
        index = {name: i for i, name in enumerate(blocks)}
        compute = [0.0] * len(blocks)
        sizes = [0] * len(blocks)
        seen = [False] * len(blocks)
        for u in self.units:
            name = u.name
            while name not in index and "." in name:
                name = name.rsplit(".", 1)[0]
            if name not in index:
                return None
            b = index[name]
            compute[b] += unit_compute_s[u.index]
            sizes[b] += self.unit_bytes[u.index]
            seen[b] = True
        if not all(seen) or len(blocks) == len(self.units):
            return None
        try:
            native = self._native_plan(sizes, budget, compute)
        except DdoError:
            return None
        return native.predicted_step_s, plan.Measured("block", compute)

    def _variants(self, measured: dict[str, Any]) -> list[plan.Measured]:
        """The plans a measured re-plan weighs (``variants``), or the measured compute as it is."""
        plain = plan.Measured(self.granularity, measured["unit_compute_s"], self.unit_plan.link_bytes)
        return (self.variants(self, measured["unit_compute_s"]) if self.variants is not None else None) or [plain]

    def coded_now(self) -> list[bool]:
        """Per unit of the plan: whether the store codes it when it streams (none without a codec)."""
        return getattr(self.store, "coded_mask", lambda: [False] * len(self.units))()

    def same_coding(self, v: plan.Measured) -> bool:
        """Whether the variant codes as this engine does (the same units, with the same codec)."""
        now = self.coded_now()
        return v.coded is not None and v.coded == now and (
            v.codec in (None, getattr(self.store, "codec", "off")) or not any(now))

    def _current_variant(self, variants: list[plan.Measured]) -> plan.Measured | None:
        """The variant that codes as this engine does, if any."""
        return next((v for v in variants if self.same_coding(v)), None)

    def _best_variant(self, measured: dict[str, Any], budget: int | None,
                      predicted: dict[str, float] | None = None) -> tuple[float, Any, plan.Measured] | None:
        """The measured variant (codec variants: which units to code) the planner predicts fastest at
        ``budget``: (predicted step, native plan, variant), or ``None`` when none fits. ``predicted``,
        when given, gets each coded variant's predicted step by label (``fixed 2/4``, ``off``)."""
        variants = self._variants(measured)
        most = max((sum(v.coded) for v in variants if v.coded), default=0)
        best: tuple[float, Any, plan.Measured] | None = None
        score = None
        own = self._codec_reserves.get(getattr(self.store, "codec", "off"), 0)
        for v in variants:
            # another codec's landing buffers in place of this one's (the rest of the reserve stays)
            reserve = (self.reserve_bytes - own + self._codec_reserves[v.codec]
                       if v.codec is not None and self._codec_reserves else None)
            try:
                native = self._native_plan(self.unit_bytes, budget, v.unit_compute_s, v.link_bytes, reserve)
            except DdoError:
                continue
            if predicted is not None and v.coded is not None:
                quarters = round(coded.QUARTERS * sum(v.coded) / most) if most else 0
                predicted[coded.label(v.codec or "off", quarters)] = native.predicted_step_s + measured["rest_s"]
            # coding must be predicted faster by a margin: never slower than not coding
            s = native.predicted_step_s * (1 + coded.LOSSLESS_MARGIN * (sum(v.coded or ()) / most if most else 0))
            if score is None or s < score - 1e-12:
                best, score = (native.predicted_step_s, native, v), s
        return best

    def _plan_measured(self, cal: Any) -> dict[str, Any] | None:
        measured = cal.resolve(len(self.units))
        current = self.calibrated_prediction()
        now = self._current_variant(self._variants(measured))
        if current is not None and now is not None and now.unit_compute_s != measured["unit_compute_s"]:
            # the current coding under the same decode model as the variants it is weighed against
            step_now, _ = plan.simulate(self.unit_plan, now.unit_compute_s, self.slots.n_slots,
                                        self.link_bytes_per_s, self.store.sim_args())
            current = {**current, "predicted_step_s": step_now + measured["rest_s"]}
        candidates: dict[str, float] = {}
        best = self._best_variant(measured, self.budget, candidates)
        if best is None:
            return None
        _, native, chosen = best
        step = native.predicted_step_s + measured["rest_s"]
        same = (list(native.resident) == list(self.plan.resident) and native.slots == self.plan.slots
                and (chosen.coded is None or self.same_coding(chosen)))
        return {
            "measured": chosen,
            "predicted_step_s": step,
            "current_predicted_step_s": current["predicted_step_s"] if current else None,
            "gain": 1 - step / current["predicted_step_s"] if current and current["predicted_step_s"] else None,
            "slots": native.slots,
            "resident_units": sum(native.resident),
            "coded_fraction": (sum(chosen.coded) / len(chosen.coded)) if chosen.coded else None,
            "codec": chosen.codec,
            "candidates_s": candidates,
            "same_plan": same,
        }

    @property
    def streamed_bytes(self) -> int:
        return sum(self.unit_bytes[u.index] for u in self.streamed)

    @property
    def resident_bytes(self) -> int:
        return self.unit_plan.base_bytes + sum(self.unit_bytes[u.index] for u in self.resident_units)

    @property
    def gpu_bytes(self) -> int:
        return self.resident_bytes + self.slots.nbytes + self.store.device_bytes

    def unit_infos(self) -> tuple[UnitInfo, ...]:
        streamed = {id(u) for u in self.streamed}
        return tuple(UnitInfo(u.name, u.module, id(u) in streamed, self.unit_bytes[u.index]) for u in self.units)

    def transport_stats(self) -> tuple[int, int, float]:
        return self.transport.stats() if self.transport is not None else self._final_transport_stats

    def report_sections(self) -> dict[str, Any]:
        slabs = self.store.slabs
        calls = self.call_records()
        secs = [c.seconds for c in calls]
        steady = secs[1:] if len(secs) > 1 else secs
        median = statistics.median(steady) if steady else None
        host = [c.host_s for c in (calls[1:] if len(calls) > 1 else calls)]
        host_median = statistics.median(host) if host else None
        fastest = min(steady) if steady else None
        fastest_call = min((c for c in (calls[1:] if len(calls) > 1 else calls)), key=lambda c: c.seconds, default=None)
        last_bytes = calls[-1].h2d_bytes if calls else None
        fetches, total_bytes, host_wait = self.transport_stats()
        total_bytes += self.graph_bytes  # graph replays move bytes the transport does not see
        calibrated = self.calibrated_prediction()
        stats = self.scheduler.stats
        roof = roofline_bound(
            link_bytes_per_s=self.link_bytes_per_s, streamed_bytes=self.streamed_bytes,
            calibrated_compute_s=calibrated["compute_s"] if calibrated else None, fastest_call_s=fastest,
            call_h2d_bytes=fastest_call.h2d_bytes if fastest_call else None, disk=self.store.disk_figures(),
        )
        sections: dict[str, Any] = {
            "plan": dict(
                unit_granularity=self.granularity,
                units=len(self.units),
                resident_units=len(self.resident_units),
                streamed_units=len(self.streamed),
                resident_bytes=self.resident_bytes,
                streamed_bytes=self.streamed_bytes,
                slots=self.slots.n_slots,
                slot_bytes=self.slots.slot_bytes,
                gpu_bytes=self.gpu_bytes,
                host_slabs=len(slabs.slab_sizes) if slabs is not None else 0,
                host_slab_bytes=slabs.nbytes if slabs is not None else 0,
                staging_bytes=self.preset.staging_bytes,
                predicted_step_s=self.plan.predicted_step_s,
                planned_with="compute measured on an earlier plan" if self.measured else "the compute prior",
            ),
            "setup": dict(
                seconds=self.setup_s,
                pack_s=self.pack_s,
                packed_bytes=slabs.bytes_packed if slabs is not None else 0,
                pack_gb_s=(slabs.bytes_packed / self.pack_s / 1e9)
                if slabs is not None and self.pack_s > 0 and slabs.bytes_packed else None,
                warm_reused=bool(slabs.reused_warm) if slabs is not None else False,
            ),
            "runtime": dict(
                calls=len(calls),
                first_call_s=secs[0] if secs else None,
                median_call_s=median,
                host_call_s=host_median,
                host_fraction=(host_median / median) if host_median is not None and median else None,
                h2d_call_bytes=last_bytes,
                h2d_gb_s=(last_bytes / median / 1e9) if median and last_bytes else None,
                copies=fetches,
                h2d_total_bytes=total_bytes,
                misses=stats.misses,
                reorders=stats.reorders,
                order_changes=stats.order_changes,
                host_wait_s=host_wait,
                calibrated_predicted_step_s=calibrated["predicted_step_s"] if calibrated else None,
                compute_wait_s=calibrated["measured_wait_s"] if calibrated else None,
            ),
            "memory": {"pinned_bytes": slabs.pinned_bytes if slabs is not None else 0},
            "roofline": {**roof, "efficiency": (roof["bound_s"] / median) if roof["bound_s"] and median else None},
            "timeline": [
                {"seconds": c.seconds, "h2d_bytes": c.h2d_bytes, "misses": c.misses,
                 "copy_s": c.h2d_bytes / self.link_bytes_per_s}
                for c in calls
            ],
        }
        sections["edits"] = {
            "settled": self.edits.settled if self.edits is not None else 0,
            "adapters": len(self.adapters),
            "adapter_bytes": sum(t.numel() * t.element_size() for t in self.adapters.values()),
            "adapter_device_copies": len(self._mirrors),
        }
        if self.graph_requested:
            runner = self.scheduler.graph
            sections["graph"] = runner.section() if runner is not None else {"enabled": True, "status": "detached"}
        better = self.measured_plan()
        if better is not None:
            sections["plan"].update(measured_plan_step_s=better["predicted_step_s"], measured_plan_gain=better["gain"],
                                    measured_plan_same=better["same_plan"],
                                    measured_plan_coded_fraction=better["coded_fraction"],
                                    measured_plan_codec=better["codec"])
        for section, fields in self.store.report_sections(self.transport).items():
            sections.setdefault(section, {}).update(fields)
        for section, fields in (self._extra_sections() if self._extra_sections else {}).items():
            sections.setdefault(section, {}).update(fields)
        return sections
