"""Host slabs: the streamed units' weights packed contiguously into a few exact-size allocations.

Each unit's tensors sit at 256-byte aligned offsets inside one slab (layout from the Rust core), so a
unit crosses the link as one copy. The module's CPU parameters become views into the slabs: host RAM
is about 1.0x the streamed weights, not a second copy. Slabs are page-locked (``cuMemHostRegister``
on the exact range) for the pinned presets, and left pageable for the staged ones.

``warm_process`` keeps slabs (and their page-locking) in a process-wide registry after ``remove()``;
parameters keep pointing into them, so offloading the same weights again finds every tensor already
in place and neither copies nor pins.

Slabs are shared between offloads of modules whose parameters point into the same host memory
(``ddo_blocks.share_weights``: a replica of a component for a second GPU): a unit whose tensors
already sit in a live slab of another offload, at this unit's own layout, is *borrowed*, neither
copied nor pinned again; each slab counts its users and is unpinned when the last one lets go (its
memory lives as long as any tensor points into it).
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _native
from ..errors import DdoError
from ..units import Unit, flat_span, own_copy, span_elements, span_nbytes, strided_view

ALIGN = 256
PAGE = 4096
MAX_SLAB_BYTES = 1 << 30
"""Slab size cap: big enough that pinning is a handful of calls, small enough that packing or
releasing one slab at a time bounds the transient extra RAM."""


@dataclass
class Slab:
    storage: torch.Tensor
    """The uint8 allocation (a little larger than the slab, so the slab can start on a page)."""
    base: torch.Tensor
    """The slab itself: ``nbytes`` bytes starting on a page boundary."""
    registration: object | None
    """``_native.HostRegistration`` while page-locked."""
    users: int = 1
    """Offloads holding the slab: its own and those that borrowed units from it."""
    engines: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    """The engines streaming from it (its own and a replica's): an edit through one is an edit of all."""

    @property
    def nbytes(self) -> int:
        return self.base.numel()

    @property
    def ptr(self) -> int:
        return self.base.data_ptr()

    def retain(self) -> Slab:
        self.users += 1
        return self

    def close(self) -> None:
        """Lets go of the slab: the last user unpins it and takes it out of the live registry."""
        self.users = max(0, self.users - 1)
        if self.users:
            return
        _LIVE.pop(self.storage.untyped_storage().data_ptr(), None)
        if self.registration is not None:
            self.registration.close()
            self.registration = None


def is_live(t: torch.Tensor) -> bool:
    """Whether ``t`` points into a live slab (an offload's host copy of its streamed units)."""
    return t.untyped_storage().data_ptr() in _LIVE


_WARM: dict[int, Slab] = {}
"""Page-locked slabs kept for the process by ``warm_process``, by slab address."""

_LIVE: weakref.WeakValueDictionary[int, Slab] = weakref.WeakValueDictionary()
"""Slabs of attached offloads, by the address of their storage: where a replica's units are found.
Weak: an offload dropped without ``remove()`` still frees its slabs."""


def release_warm_slabs() -> int:
    """Unpins and forgets every slab ``warm_process`` kept. Parameters that still point into them
    keep their values (the memory stays allocated while referenced). Returns the bytes released."""
    total = 0
    for slab in list(_WARM.values()):
        total += slab.nbytes
        slab.close()
    _WARM.clear()
    return total


def warm_bytes() -> int:
    """Bytes currently kept page-locked by ``warm_process``."""
    return sum(s.nbytes for s in _WARM.values())


class PinnedBuffer:
    """A page-locked uint8 host buffer of exactly ``nbytes``, registered by ddo_blocks and unpinned
    by :meth:`close`. (``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host
    allocator, which rounds up to a power of two and keeps the memory pinned for the process.)"""

    def __init__(self, nbytes: int, ordinal: int):
        self.storage, self.tensor = _alloc(nbytes)
        self._registration = _native.HostRegistration(self.storage, self.tensor.data_ptr(), nbytes, ordinal)

    def close(self) -> None:
        self._registration.close()

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alloc(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    storage = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = (-storage.data_ptr()) % PAGE
    return storage, storage[skip : skip + nbytes]


PROGRESS_BYTES = 1 << 30
"""Packing at least this much shows a progress bar (on a terminal; tqdm stays silent elsewhere)."""


def _progress(total: int, what: str, *, quiet: bool = False) -> Any:
    """A byte progress bar for long setup work, or a silent stand-in."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"ddo_blocks: {what}", leave=False,
                disable=True if quiet or total < PROGRESS_BYTES else None)


class SlabSet:
    """The host side of one offloaded component's streamed units."""

    def __init__(self, units: list[Unit], *, pin: bool, ordinal: int, keep_warm: bool):
        self.units = units
        self.pin = pin
        self.keep_warm = keep_warm
        self.ordinal = ordinal
        layouts = [_native.layout_unit([span_nbytes(p) for _, p in u.params]) for u in units]
        self.param_offsets: list[list[int]] = [layout.offsets for layout in layouts]
        self.unit_nbytes: list[int] = [layout.nbytes for layout in layouts]
        slab_layout = _native.layout_slabs(self.unit_nbytes, MAX_SLAB_BYTES)
        self.slab_sizes: list[int] = slab_layout.slabs
        self.placement: list[tuple[int, int]] = [(p.slab, p.offset) for p in slab_layout.placements]
        self.slabs: list[Slab] = []
        self.host_views: list[list[torch.Tensor]] = []
        self.reused_warm = False
        self.bytes_packed = 0
        self.borrowed: dict[int, tuple[Slab, int]] = {}
        """Units found in another offload's live slab: unit -> (that slab, the unit's offset in it)."""

    def _find_borrowed(self) -> dict[int, tuple[Slab, int]]:
        """The units whose tensors all sit in one live slab at this unit's layout, as this set
        would pin it (pinned slabs for a pinned set, pageable for a pageable one)."""
        if not _LIVE or self.keep_warm:
            return {}
        found: dict[int, tuple[Slab, int]] = {}
        for u, (unit, offsets) in enumerate(zip(self.units, self.param_offsets)):
            first = unit.params[0][1] if unit.params else None
            if first is None or first.device.type != "cpu":
                continue
            slab = _LIVE.get(first.untyped_storage().data_ptr())
            if slab is None or (slab.registration is not None) != self.pin:
                continue
            at = first.data_ptr() - slab.ptr - offsets[0]
            if at < 0 or at + self.unit_nbytes[u] > slab.nbytes:
                continue
            if all(p.device.type == "cpu" and p.untyped_storage().data_ptr() == slab.storage.untyped_storage().data_ptr()
                   and p.data_ptr() == slab.ptr + at + off for (_, p), off in zip(unit.params, offsets)):
                found[u] = (slab, at)
        return found

    # -- setup -------------------------------------------------------------------------------------
    def _find_warm(self) -> list[Slab] | None:
        """The warm slabs that already hold every streamed tensor at its planned place, if any."""
        if not self.keep_warm or not _WARM or not self.units:
            return None
        slabs: dict[int, Slab] = {}
        for unit, offsets, (s, uoff) in zip(self.units, self.param_offsets, self.placement):
            for (_, p), off in zip(unit.params, offsets):
                if p.device.type != "cpu":
                    return None
                storage_ptr = p.untyped_storage().data_ptr()
                slab = slabs.get(s)
                if slab is None:
                    slab = next((w for w in _WARM.values() if w.storage.data_ptr() == storage_ptr), None)
                    if slab is None or slab.nbytes != self.slab_sizes[s]:
                        return None
                    slabs[s] = slab
                if p.data_ptr() != slab.ptr + uoff + off or not p.is_contiguous():
                    return None
        if sorted(slabs) != list(range(len(self.slab_sizes))):
            return None
        return [slabs[i] for i in range(len(self.slab_sizes))]

    def pack(self, loader: Any = None) -> None:
        """Allocates the slabs, copies every streamed tensor in, points the parameters at their
        slab views, and page-locks each slab (pinned presets). One slab at a time, so the extra
        host memory during setup is at most one slab."""
        warm = self._find_warm()
        if warm is not None:
            self.slabs = warm
            self.reused_warm = True
            for slab in warm:
                _WARM.pop(slab.ptr, None)
            self.host_views = [[p.data for _, p in unit.params] for unit in self.units]
            return
        self.borrowed = self._find_borrowed()
        if self.borrowed:
            self._layout_own([u for u in range(len(self.units)) if u not in self.borrowed])
        # Warm slabs that hold some of these tensors at another layout (another budget or preset): the
        # tensors are copied out of them below, after which nothing points into them.
        storages = {p.untyped_storage().data_ptr() for u in self.units for _, p in u.params if p.device.type == "cpu"}
        stale = [w for w in _WARM.values() if w.storage.data_ptr() in storages]
        by_slab: list[list[int]] = [[] for _ in self.slab_sizes]
        for u, (s, _) in enumerate(self.placement):
            if u not in self.borrowed:
                by_slab[s].append(u)
        self.host_views = [[] for _ in self.units]
        # Page-locking a slab (about 0.1 s per GiB) runs on a background thread while the next slab
        # is filled; the registration call releases the GIL.
        pinning: list[tuple[Slab, Future]] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddo-pin") as pool, _progress(
                sum(self.slab_sizes), "packing", quiet=loader is not None) as bar:
            try:
                for s, size in enumerate(self.slab_sizes):
                    slab = self._fill_slab(s, size, by_slab[s], loader)
                    bar.update(size)
                    if self.pin:
                        pinning.append((slab, pool.submit(
                            _native.HostRegistration, slab.storage, slab.ptr, size, self.ordinal)))
            finally:
                errors = []
                for slab, future in pinning:
                    try:
                        slab.registration = future.result()
                    except DdoError as exc:  # keep the others, so a rollback can unpin them
                        errors.append(exc)
                if errors:
                    raise errors[0]
        for w in stale:  # unpin and forget them (tensors outside these units keep their memory alive)
            _WARM.pop(w.ptr, None)
            w.close()
        for slab in self.slabs:
            _LIVE[slab.storage.untyped_storage().data_ptr()] = slab
        # borrowed units: their slabs come after this set's own, retained once each
        held: dict[int, int] = {}
        for u, (slab, at) in self.borrowed.items():
            if id(slab) not in held:
                held[id(slab)] = len(self.slabs)
                self.slabs.append(slab.retain())
            self.placement[u] = (held[id(slab)], at)
            self.host_views[u] = [p.data for _, p in self.units[u].params]

    def _layout_own(self, own: list[int]) -> None:
        """Slabs for the units not borrowed only (the borrowed ones are placed after packing)."""
        layout = _native.layout_slabs([self.unit_nbytes[u] for u in own], MAX_SLAB_BYTES)
        self.slab_sizes = layout.slabs
        self.placement = [(0, 0)] * len(self.units)
        for u, p in zip(own, layout.placements):
            self.placement[u] = (p.slab, p.offset)

    def _fill_slab(self, s: int, size: int, units: list[int], loader: Any) -> Slab:
        storage, base = _alloc(size)
        slab = Slab(storage, base, None)
        self.slabs.append(slab)
        jobs: list[tuple[int, int, int]] = []
        moves: list[tuple[int, torch.nn.Parameter, torch.Tensor]] = []
        reads: list[tuple[Any, torch.Tensor]] = []
        for u in units:
            uoff = self.placement[u][1]
            for (_, p), off in zip(self.units[u].params, self.param_offsets[u]):
                # the parameter's own strides (a transposed or expanded weight stays one), so the
                # kernels it runs with are the resident run's
                v = strided_view(base, uoff + off, p.data)
                if loader is not None and loader.pending(p):
                    reads.append((loader.take(p), v))
                elif p.device.type == "cpu" and type(p.data) is torch.Tensor:
                    jobs.append((v.data_ptr(), p.data_ptr(), span_nbytes(v)))  # the storage it spans
                else:
                    flat_span(v).copy_(flat_span(p.data))
                moves.append((u, p, v))
        _native.copy_host_many(jobs)  # parallel, GIL released
        if reads:
            loader.read_many(reads)  # straight from the files, parallel positional reads
        # only now, with the bytes in place, do parameters (and a rollback) see the slab
        for u, p, v in moves:
            p.data = v
            self.host_views[u].append(v)
            self.bytes_packed += span_nbytes(v)
        return slab

    # -- access ------------------------------------------------------------------------------------
    def unit_ptr(self, u: int) -> int:
        s, off = self.placement[u]
        return self.slabs[s].ptr + off

    @property
    def pinned_bytes(self) -> int:
        """Bytes this set page-locked (its own slabs; borrowed ones are counted by their owner)."""
        return sum(s.nbytes for s in self.slabs[: len(self.slab_sizes)] if s.registration is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of this set's own slabs (what it added to host RAM)."""
        return sum(self.slab_sizes)

    @property
    def borrowed_bytes(self) -> int:
        """Bytes of the units found in another offload's slabs (not copied, not pinned again)."""
        return sum(self.unit_nbytes[u] for u in self.borrowed)

    # -- teardown ----------------------------------------------------------------------------------
    def discard(self) -> None:
        """Lets go of the slabs without restoring any parameter (they point at another copy now: the
        vmm route's private arena keeps no host copy of its resident units). The caller made sure no
        copy from them is still in flight."""
        slabs, self.slabs, self.host_views = self.slabs, [], []
        for slab in slabs:
            slab.close()

    def release(self, orig_device: dict[int, torch.device], keep_warm: bool) -> None:
        """Gives every parameter its own memory back on its original device and frees the slabs,
        one at a time. With ``keep_warm``, parameters of CPU modules stay in their (still pinned)
        slabs, which move to the process registry for the next offload of the same weights."""
        all_cpu = all(orig_device[id(p)].type == "cpu" for u in self.units for _, p in u.params)
        if keep_warm and all_cpu:
            for u, unit in enumerate(self.units):
                for (_, p), v in zip(unit.params, self.host_views[u]):
                    p.data = v
            for slab in self.slabs:
                _LIVE.pop(slab.storage.untyped_storage().data_ptr(), None)
                _WARM[slab.ptr] = slab
            self.slabs = []
            return
        by_slab: list[list[int]] = [[] for _ in self.slabs]
        for u, (s, _) in enumerate(self.placement):
            if s < len(by_slab):
                by_slab[s].append(u)
        slabs, self.slabs = self.slabs, []
        for s in range(len(slabs)):
            slab = slabs[s]
            jobs: list[tuple[int, int, int]] = []
            moves: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
            for u in by_slab[s]:
                views = self.host_views[u] if u < len(self.host_views) else []
                for (_, p), v in zip(self.units[u].params, views):
                    dev = orig_device[id(p)]
                    if dev.type == "cpu":  # fresh memory from PyTorch's allocator, the original strides
                        own = torch.empty(span_elements(v), dtype=v.dtype).as_strided(v.shape, v.stride())
                        jobs.append((own.data_ptr(), v.data_ptr(), span_nbytes(v)))
                    else:
                        own = own_copy(v, dev)
                    moves.append((p, own))
                if u < len(self.host_views):
                    self.host_views[u] = []
            _native.copy_host_many(jobs)  # parallel, GIL released
            for p, own in moves:
                p.data = own
            # this slab is no longer referenced: unpin and free it before copying out the next one,
            # so the extra host memory during remove() stays at one slab
            slab.close()
            slabs[s] = None  # type: ignore[call-overload]
            del slab
        self.host_views = []
