"""The VMM arena: one VRAM budget for the weights of several components on one device, every weight at
an address that never changes, and resident weights that survive phases and calls.

    Arena                   the budget, the chunk pool (``_native.VmmArena``), its members, eviction
      └─ Member (one per component on the vmm route)
           ├─ home range    its resident units, laid out in priority order, bound once
           ├─ slot range    its K streaming slots (as the linear route's, inside the arena)
           └─ host copies   a pinned slab of each resident unit, to restore what was evicted (none
                            on a private arena: one component, nothing ever evicted)

A component's plan (which units stay resident, how many slots) is the linear route's plan for the
whole arena budget less what the other members keep outside the arena (their buffers and the few
weights that belong to no unit). While a component runs, all of its home and slot chunks are mapped;
when another needs room, it takes chunks from the members it finds least recently called: first
their slots (nothing to copy back), then their home ranges from the tail (the lowest priority first:
within a component the order is static, because LRU is the worst policy for a cyclic pass). Each
unmap waits for that member's last-use event and its copy stream, never for the whole device.
Eviction happens only at a call's start, so inside a step the route streams as the linear route does.

An evicted unit's parameters point at its host copy (a CPU tensor: a stray use fails with a device
error instead of reading unmapped memory); its next call maps the chunks again at the same
addresses, copies the evicted units back and points the parameters at the same views.

``Arena("auto")`` sizes each phase from the free memory and that member's measured activations
(:class:`AutoArena`).

With ``device="cpu"`` (tests only: ``Arena(..., _backend=HostChunks(...))``) ranges are ordinary
memory and unmapped chunks are overwritten, so a unit used without its restore gives wrong values.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
from torch import nn

from .. import _native
from ..budget import fmt_bytes, parse_bytes
from ..errors import BudgetError, ConfigError, CudaNotAvailableError, DdoError, OffloadMemoryError
from ..units import Unit, geometry, span_nbytes, strided_view
from .edits import get_data, set_data
from .slots import TorchSlots

CHUNK_BYTES = 32 << 20
"""A physical chunk: 2 MiB pages cost 58 ms per GiB to map on an H200, 32 MiB pages 4.2 ms."""

HOME_ALIGN = 256
"""Each resident unit starts at this alignment in its home range (a unit's tensors are 256-aligned in it)."""

_clock = itertools.count(1)


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


class _Span:
    """``__cuda_array_interface__`` of a byte range: what ``torch.as_tensor`` builds a tensor over."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class CudaChunks:
    """Chunks of device memory behind reserved ranges (``_native.VmmArena``)."""

    def __init__(self, device: torch.device, chunk_bytes: int, max_bytes: int):
        self.device = device
        self.native = _native.VmmArena(device.index or 0, chunk_bytes, max_bytes)
        self.chunk_bytes = self.native.chunk_bytes
        self._size: dict[int, int] = {}

    def reserve(self, nbytes: int) -> int:
        n = -(-max(nbytes, 1) // self.chunk_bytes)
        base = self.native.reserve(n * self.chunk_bytes)
        self._size[base] = n * self.chunk_bytes
        return base

    def tensor(self, base: int) -> torch.Tensor:
        """A uint8 tensor over the whole range (its first chunk mapped: torch asks the driver where it lives)."""
        return torch.as_tensor(_Span(base, self._size[base]), device=self.device)

    def map(self, base: int, first: int, count: int) -> int:
        try:
            return self.native.map(base, first, count)
        except OffloadMemoryError as exc:
            if "cuMemCreate" not in str(exc):  # the arena's own cap: nothing to give back
                raise
            # PyTorch's caching allocator may hold freed blocks (another phase's activations, an
            # encoder's): give them back to the driver and map once more (what is mapped is skipped)
            torch.cuda.empty_cache()
            return self.native.map(base, first, count)

    def unmap(self, base: int, first: int, count: int) -> int:
        return self.native.unmap(base, first, count)

    def mapped(self, base: int) -> list[bool]:
        return self.native.mapped(base)

    def free_range(self, base: int) -> None:
        self._size.pop(base, None)
        self.native.free_range(base)

    def set_max_bytes(self, max_bytes: int) -> None:
        self.native.set_max_bytes(max_bytes)

    def stats(self) -> dict[str, int]:
        chunk, created, mapped, max_chunks, creations, maps = self.native.stats()
        return dict(chunk_bytes=chunk, created=created, mapped=mapped, max_chunks=max_chunks, creations=creations,
                    maps=maps)

    def close(self) -> None:
        self.native.close()


class HostChunks:
    """The same calls over host memory, for the CPU tests: a range is one CPU tensor, mapping counts
    chunks against the cap, unmapping overwrites the chunk (0xFF: NaN in every float format)."""

    def __init__(self, chunk_bytes: int, max_bytes: int):
        self.device = torch.device("cpu")
        self.chunk_bytes = chunk_bytes
        self.max_chunks = max_bytes // chunk_bytes
        self._ranges: dict[int, tuple[torch.Tensor, list[bool]]] = {}
        self.creations = 0
        self.maps = 0
        self._created = 0

    def reserve(self, nbytes: int) -> int:
        n = -(-max(nbytes, 1) // self.chunk_bytes)
        t = torch.full((n * self.chunk_bytes,), 0xFF, dtype=torch.uint8)
        self._ranges[t.data_ptr()] = (t, [False] * n)
        return t.data_ptr()

    def tensor(self, base: int) -> torch.Tensor:
        return self._ranges[base][0]

    def _mapped_total(self) -> int:
        return sum(sum(m) for _, m in self._ranges.values())

    def map(self, base: int, first: int, count: int) -> int:
        t, mapped = self._ranges[base]
        done = 0
        for i in range(first, first + count):
            if mapped[i]:
                continue
            if self._mapped_total() >= self.max_chunks:
                raise OffloadMemoryError(f"the arena's cap of {self.max_chunks} chunks is reached")
            mapped[i] = True
            self.maps += 1
            if self._mapped_total() > self._created:
                self._created += 1
                self.creations += 1
            done += 1
        return done

    def unmap(self, base: int, first: int, count: int) -> int:
        t, mapped = self._ranges[base]
        done = 0
        for i in range(first, first + count):
            if mapped[i]:
                mapped[i] = False
                t[i * self.chunk_bytes:(i + 1) * self.chunk_bytes].fill_(0xFF)
                done += 1
        return done

    def mapped(self, base: int) -> list[bool]:
        return list(self._ranges[base][1])

    def free_range(self, base: int) -> None:
        self._ranges.pop(base, None)

    def set_max_bytes(self, max_bytes: int) -> None:
        self.max_chunks = max_bytes // self.chunk_bytes

    def stats(self) -> dict[str, int]:
        mapped = self._mapped_total()
        return dict(chunk_bytes=self.chunk_bytes, created=max(mapped, self._created), mapped=mapped,
                    max_chunks=self.max_chunks, creations=self.creations, maps=self.maps)

    def close(self) -> None:
        self._ranges.clear()


class AutoArena:
    """``Arena("auto")``: the device's free memory ``F`` when the arena is made; a first budget of
    ``F / 2`` (the activations are not known yet); each member's activation peak ``A`` measured on its
    first call (PyTorch's peak allocated less what was allocated when the call began); from then on,
    that member's calls run with a budget of ``F - A - margin``: the phase with big activations (a
    VAE decode) takes chunks from the others and gives them to PyTorch, the denoiser's phase has them
    back. A member that planned with the whole arena is planned again once after its first call, with
    its phase's budget (``OffloadHandle``), when that is at least 10 % more. A member whose first call
    ran out of device memory (:attr:`squeezed`) is attached at its smallest plan; its phase holds only
    what it holds itself until its next call measures ``A``, and is then ``F - A - margin`` without the
    floor of ``F / 4`` the others keep."""

    def __init__(self, free_bytes: int):
        from ..autobudget import MARGIN_BYTES, MARGIN_FRACTION, START_FRACTION

        self.free_bytes = free_bytes
        self.margin = int(MARGIN_BYTES + MARGIN_FRACTION * free_bytes)
        self.first_bytes = int(free_bytes * START_FRACTION)
        self.activations: dict[str, int] = {}
        self.squeezed: set[str] = set()
        """Members whose first call ran out of device memory at the first budget: until their activations
        are measured their phase holds only what they hold themselves, and once measured it is not
        kept above the free memory less them (no floor)."""

    @classmethod
    def at_creation(cls, device: torch.device) -> AutoArena:
        from .. import autobudget

        return cls(autobudget.free_bytes(device))

    def set_aside(self, nbytes: int) -> None:
        """Memory that other placements will take from the free memory measured (components on their
        own policies in the same pipeline)."""
        from ..autobudget import START_FRACTION

        self.free_bytes = max(0, self.free_bytes - nbytes)
        self.first_bytes = int(self.free_bytes * START_FRACTION)

    def phase_budget(self, name: str) -> int:
        act, squeezed = self.activations.get(name), name in self.squeezed
        if act is None:
            return 0 if squeezed else self.first_bytes  # 0: the arena's phase is what the member holds
        return max(0 if squeezed else self.first_bytes // 2, self.free_bytes - act - self.margin)

    def section(self) -> dict[str, Any]:
        out: dict[str, Any] = {"auto_free_bytes": self.free_bytes, "auto_first_bytes": self.first_bytes,
                               "auto_margin_bytes": self.margin}
        out.update({f"{name}_activation_bytes": a for name, a in self.activations.items()})
        if self.squeezed:
            out["auto_out_of_memory_at_first_call"] = sorted(self.squeezed)
        return out


class Arena:
    """One VRAM budget for the weights of every component placed on it (``route="vmm"``).

    Args:
        vram_budget: bytes (or ``"16GiB"``) for all the members' weights on the device together: the
            chunks mapped for their resident units and slots, plus what each keeps outside the arena
            (buffers, weights in no unit). Activations come on top, as on every route. ``"auto"``: from
            the free memory, phase by phase (:class:`AutoArena`).
        device: ``cuda`` or ``cuda:N``.
        chunk_bytes: physical chunk size (rounded up to the device's granularity).
        headroom: bytes kept out of the plans for components that join after the one planning with the
            whole arena (their buffers and the weights in no unit land outside the arena): attach that
            component last, or leave some headroom (``wrap`` leaves 64 MiB: its decode stage joins after
            the denoiser). Components checked before they attach (``expect``) are counted exactly.

    Pass it to ``offload(module, route="vmm", arena=arena)`` for each component, or let
    ``offload_pipeline(pipe, preset="vmm_fast", vram_budget=...)`` make one for a whole pipeline. A
    component plans with the whole arena unless given its own ``vram_budget`` (``"min"``, bytes): give
    the components called once per image (text encoders) ``"min"`` and the denoiser, called at every
    step, the rest: the encoders' chunks then go to the denoiser during the steps, and what the
    denoiser gives up for an encoder's call comes back once per image, not once per step.
    ``report()`` gives the arena's figures; ``close()`` after every member was removed.
    """

    def __init__(self, vram_budget: int | str, device: str | torch.device = "cuda", *,
                 chunk_bytes: int = CHUNK_BYTES, headroom: int | str = 0, _backend: Any = None):
        from ..api import resolve_device

        self.device = resolve_device(device) if _backend is None else _backend.device
        if self.device.type != "cuda" and _backend is None:
            raise CudaNotAvailableError(
                f"route='vmm' maps weights into CUDA virtual memory and needs a CUDA device, got {self.device}; "
                "use route='linear' on the CPU"
            )
        self.auto: AutoArena | None = AutoArena.at_creation(self.device) if vram_budget == "auto" else None
        budget = self.auto.first_bytes if self.auto is not None else parse_bytes(vram_budget, what="vram_budget")
        if budget is None or budget <= 0:
            raise ConfigError(f"an Arena needs a positive vram_budget (bytes, a size such as '16GiB', or 'auto'), "
                              f"got {vram_budget!r}")
        self.budget = budget
        """The budget in force: fixed, or with ``"auto"`` the current phase's (see :class:`AutoArena`)."""
        self.headroom = parse_bytes(headroom, what="headroom") or 0
        self.expected: dict[str, int] = {}
        """Fixed bytes of components checked for this arena (``expect``) and not joined yet."""
        self.lock = threading.RLock()
        self.members: list[Member] = []
        if _backend is None:
            _backend = CudaChunks(self.device, chunk_bytes, budget)
        self.backend = _backend
        self.chunk_bytes = self.backend.chunk_bytes
        self.evictions = 0
        self.evicted_bytes = 0
        self.placed_bytes = 0
        self.restored_bytes = 0
        self.peak_mapped_chunks = 0
        self.peak_device_bytes = 0
        """The most the arena held at once: chunks mapped plus its members' fixed bytes at that moment."""
        self.closed = False
        self.private = False
        """Made by ``offload(route="vmm", vram_budget=...)`` for one component: closed when it leaves."""

    # -- budget ------------------------------------------------------------------------------------
    @property
    def fixed_bytes(self) -> int:
        """What the members keep on the device outside the arena (torch-allocated, never evicted)."""
        return sum(m.fixed_bytes for m in self.members)

    def plan_budget(self, name: str = "") -> int:
        """The budget a new member plans its weights with (its own fixed bytes included, as every
        plan counts them): the whole budget less what the other members keep outside the arena, what
        the components expected to join will keep there, and the headroom."""
        expected = sum(b for n, b in self.expected.items() if n != name)
        return self.budget - self.fixed_bytes - expected - self.headroom

    def expect(self, name: str, fixed_bytes: int) -> None:
        """A component that will join (checked before the pipeline runs): members that plan before it
        leave its fixed bytes free."""
        with self.lock:
            if not any(m.name == name for m in self.members):
                self.expected[name] = fixed_bytes

    def reserve_bytes(self, n_units: int) -> int:
        """What a member's plan leaves aside for rounding: its two ranges to whole chunks, its units
        to ``HOME_ALIGN``."""
        return 2 * self.chunk_bytes + HOME_ALIGN * n_units

    @property
    def cap_chunks(self) -> int:
        return max(0, (self.budget - self.fixed_bytes) // self.chunk_bytes)

    def mapped_chunks(self) -> int:
        return sum(m.mapped_chunks() for m in self.members)

    def member_cap_chunks(self, member: Member) -> int:
        """The chunks ``member``'s own calls may map: the fixed budget's cap, or with ``"auto"`` its
        phase's (another member's phase may be smaller: that member's calls evict part of it)."""
        if self.auto is None:
            return self.cap_chunks
        cap = max(0, (self.auto.phase_budget(member.name) - self.fixed_bytes) // self.chunk_bytes)
        # a squeezed member's phase is at least what it holds itself (as enter_phase makes it)
        return max(cap, member.working_chunks()) if member.name in self.auto.squeezed else cap

    def join(self, member: Member) -> None:
        """Adds a member (at its attach): every member's own working set must still fit beside the
        others' fixed bytes, or the attach is refused."""
        with self.lock:
            if self.closed:
                raise ConfigError("this Arena was closed; make a new one")
            if not same_device(member.engine.device, self.device):
                raise ConfigError(f"an Arena lives on one device ({self.device}); the component is on "
                                  f"{member.engine.device}")
            self.members.append(member)
            self.expected.pop(member.name, None)
            member.busy += 1  # attaching: not evicted until its attach is done (ArenaSlots.ready)
            self.backend.set_max_bytes(self.cap_chunks * self.chunk_bytes)
            # every member's working set fits its own phase; the joining one is placed now, in the phase in force
            worst = next((m for m in self.members
                          if m.working_chunks() > (self.cap_chunks if m is member else self.member_cap_chunks(m))),
                         None)
            if worst is not None:
                fixed = self.fixed_bytes
                need = worst.working_chunks() * self.chunk_bytes + fixed
                self.members.remove(member)
                member.busy -= 1
                self.backend.set_max_bytes(self.cap_chunks * self.chunk_bytes)
                raise BudgetError(
                    f"the arena's vram_budget={fmt_bytes(self.budget)} cannot hold {worst.name}'s working set "
                    f"({fmt_bytes(worst.working_chunks() * self.chunk_bytes)} in whole chunks) beside the "
                    f"{fmt_bytes(fixed)} its members would keep outside the arena with {member.name}; give the Arena a "
                    f"vram_budget of at least {fmt_bytes(need)}, or put {member.name} on another route"
                )
            # its fixed bytes go to the device next (PyTorch's): the others' chunks make room first
            try:
                self.make_room(member, 0)
            except BaseException:
                self.members.remove(member)
                member.busy -= 1
                self.backend.set_max_bytes(self.cap_chunks * self.chunk_bytes)
                raise
            self.note_mapped()

    def leave(self, member: Member) -> None:
        with self.lock:
            if member in self.members:
                self.members.remove(member)
                self.backend.set_max_bytes(self.cap_chunks * self.chunk_bytes)
            if self.private and not self.members:
                self.close()

    def set_aside(self, nbytes: int) -> None:
        """``"auto"``: memory that other placements will take from the free memory it measured."""
        with self.lock:
            if self.auto is not None:
                self.auto.set_aside(nbytes)
                self.budget = self.auto.first_bytes
                self.backend.set_max_bytes(self.cap_chunks * self.chunk_bytes)

    def enter_phase(self, member: Member) -> None:
        """``vram_budget="auto"``: the budget of ``member``'s call (the free memory at creation less its
        measured activations and a margin, the first budget until measured), never below what the member
        itself holds; the other members give back what the lower budget leaves no room for, and the
        chunks beyond it go back to the driver (PyTorch's activations need them)."""
        if self.auto is None:
            return
        with self.lock:
            own = member.working_chunks() * self.chunk_bytes + self.fixed_bytes
            budget = max(self.auto.phase_budget(member.name), own)
            if budget != self.budget:
                before, self.budget = self.budget, budget
                try:
                    self.make_room(member, 0)
                except BaseException:
                    self.budget = before  # the others could not give back enough (one is running): as it was
                    raise
                self.backend.set_max_bytes(self.cap_chunks * self.chunk_bytes)

    def make_room(self, member: Member, need: int) -> None:
        """Unmaps chunks of other members (least recently called first) until ``need`` more chunks fit."""
        with self.lock:
            free = self.cap_chunks - self.mapped_chunks()
            others = [m for m in self.members if m is not member and not m.busy]
            for other in sorted(others, key=lambda m: m.last_call):
                if free >= need:
                    break
                got = other.evict(need - free)
                if got:
                    self.evictions += 1
                    self.evicted_bytes += got * self.chunk_bytes
                free += got
            if free < need:
                busy = [m.name for m in self.members if m is not member and m.busy and m.mapped_chunks()]
                why = (f"; {', '.join(busy)} hold(s) the rest and {'is' if len(busy) == 1 else 'are'} running now (a "
                       "call in another thread, or still attaching): call the arena's components one at a time"
                       if busy else "")
                raise BudgetError(
                    f"the arena ({fmt_bytes(self.budget)}) has no room for {fmt_bytes(need * self.chunk_bytes)} more "
                    f"of {member.name}'s chunks{why}; or give the Arena a larger vram_budget"
                )

    def report_section(self) -> dict[str, Any]:
        """:meth:`report` flat, for a member's report: each member's mapped bytes as its own field."""
        fig = self.report()
        members = fig.pop("members")
        fig.update({f"{name}_mapped_bytes": m["mapped_bytes"] for name, m in members.items()})
        return fig

    def note_mapped(self) -> None:
        mapped = self.mapped_chunks()
        self.peak_mapped_chunks = max(self.peak_mapped_chunks, mapped)
        self.peak_device_bytes = max(self.peak_device_bytes, mapped * self.chunk_bytes + self.fixed_bytes)

    def report(self) -> dict[str, Any]:
        """The arena's figures: budget, chunks, evictions and what they cost, per member."""
        with self.lock:
            return self._report()

    def _report(self) -> dict[str, Any]:
        stats = self.backend.stats() if not self.closed else {"creations": 0, "maps": 0}
        return dict(
            device=str(self.device),
            vram_budget=self.budget,
            chunk_bytes=self.chunk_bytes,
            fixed_bytes=self.fixed_bytes,
            cap_bytes=self.cap_chunks * self.chunk_bytes,
            mapped_bytes=self.mapped_chunks() * self.chunk_bytes,
            peak_mapped_bytes=self.peak_mapped_chunks * self.chunk_bytes,
            peak_device_bytes=self.peak_device_bytes,
            chunks_created=stats["creations"],
            chunk_maps=stats["maps"],
            evictions=self.evictions,
            evicted_bytes=self.evicted_bytes,
            placed_bytes=self.placed_bytes,
            restored_bytes=self.restored_bytes,
            members={m.name: m.figures() for m in self.members},
            **(self.auto.section() if self.auto is not None else {}),
        )

    def close(self) -> None:
        """Gives the chunk pool back (after every member was removed)."""
        with self.lock:
            if self.members:
                raise ConfigError(f"the Arena still holds {', '.join(m.name for m in self.members)}; remove() "
                                  "their offloads first")
            if not self.closed:
                self.backend.close()
                self.closed = True

    def __deepcopy__(self, memo: dict) -> Arena:
        return self  # a policy copied by wrap() still names the same arena

    def __repr__(self) -> str:
        return (f"Arena({fmt_bytes(self.budget)} on {self.device}, {len(self.members)} member(s), "
                f"{fmt_bytes(self.mapped_chunks() * self.chunk_bytes)} mapped)")


class Member:
    """One component's part of an arena: its home and slot ranges, what is mapped and loaded."""

    def __init__(self, arena: Arena, engine: Any, name: str):
        self.arena = arena
        self.engine = engine
        self.name = name
        self.fixed_bytes = 0
        self.chunk = arena.chunk_bytes
        self.units: list[Unit] = []
        self.home_offsets: list[int] = []
        self.home_nbytes = 0
        self.home_base: int | None = None
        self.home: torch.Tensor | None = None
        self.home_views: list[list[torch.Tensor]] = []
        self.loaded: list[bool] = []
        self.home_mapped = 0
        """Chunks of the home range mapped: always a prefix (the tail is evicted first)."""
        self.host: Any = None
        self.slot_nbytes = 0
        self.slot_base: int | None = None
        self.slot_tensor: torch.Tensor | None = None
        self.slots_mapped = False
        self.last_call = 0
        self._peak: Any = None
        self.busy = 0
        """Attaching, or in a call (entry point or a unit called on its own): never evicted then."""
        self._fence: Any = None
        self.restores = 0
        self._placed = False

    # -- sizes -------------------------------------------------------------------------------------
    def _chunks(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk) if nbytes else 0

    @property
    def home_chunks(self) -> int:
        return self._chunks(self.home_nbytes)

    @property
    def slot_chunks(self) -> int:
        return self._chunks(self.slot_nbytes)

    def working_chunks(self) -> int:
        return self.home_chunks + self.slot_chunks

    def mapped_chunks(self) -> int:
        return self.home_mapped + (self.slot_chunks if self.slots_mapped else 0)

    # -- attach ------------------------------------------------------------------------------------
    def lay_out(self, units: list[Unit], slot_nbytes: int) -> None:
        """Fixes the home layout of the resident units (in priority order) and the slot range size."""
        self.units = units
        layouts = [_native.layout_unit([span_nbytes(p) for _, p in u.params]) for u in units]
        off = 0
        self.home_offsets = []
        for layout in layouts:
            self.home_offsets.append(off)
            off += -(-layout.nbytes // HOME_ALIGN) * HOME_ALIGN
        self.home_nbytes = off
        self._unit_layouts = layouts
        self.slot_nbytes = slot_nbytes

    def place(self, loader: Any) -> None:
        """Packs host copies of the resident units, maps the home range and uploads them."""
        with self.arena.lock:
            self._place(loader)

    def _place(self, loader: Any) -> None:
        from .slabs import SlabSet

        e = self.engine
        if self.units:
            self.host = SlabSet(self.units, pin=e.device.type == "cuda", ordinal=e.device.index or 0, keep_warm=False)
            self.host.pack(loader)
            self.home_base = self.arena.backend.reserve(self.home_nbytes)
            self._map_home()
            self.home = self.arena.backend.tensor(self.home_base)
            self.home_views = []
            for unit, off, layout in zip(self.units, self.home_offsets, self._unit_layouts):
                region = self.home[off: off + layout.nbytes]
                self.home_views.append([strided_view(region, o, geometry(p))
                                        for (_, p), o in zip(unit.params, layout.offsets)])
            self.loaded = [False] * len(self.units)
            self._upload_missing()
            if self.arena.private:  # nobody else will ever take its chunks: no host copy to restore from
                if e._copy_stream is not None:
                    e._copy_stream.synchronize()  # the uploads read the slabs
                self.host.discard()
                self.host = None
        self._placed = True

    def build_slots(self) -> torch.Tensor:
        """Maps the slot range; returns a uint8 tensor over it (the slot pool's storage)."""
        with self.arena.lock:
            self.slot_base = self.arena.backend.reserve(self.slot_nbytes)
            self._map_slots()
            self.slot_tensor = self.arena.backend.tensor(self.slot_base)[: self.slot_nbytes]
            return self.slot_tensor

    def _map(self, base: int, first: int, count: int) -> None:
        try:
            self.arena.backend.map(base, first, count)
        except OffloadMemoryError as exc:
            raise OffloadMemoryError(
                f"out of GPU memory mapping {count} chunk(s) of {fmt_bytes(self.chunk)} for {self.name} in the arena "
                f"({fmt_bytes(self.arena.budget)} on {self.arena.device}): the device has less free memory than the "
                f"arena's budget (or the arena's own cap refused, after an earlier failure); free GPU memory or give "
                f"the Arena a smaller vram_budget ({exc})"
            ) from exc

    def _map_home(self) -> None:
        missing = self.home_chunks - self.home_mapped
        if missing <= 0:
            return
        self.arena.make_room(self, missing)
        try:
            self._map(self.home_base, self.home_mapped, missing)
        finally:  # a prefix is mapped even when a later chunk failed: count what is there
            mapped = self.arena.backend.mapped(self.home_base)
            self.home_mapped = next((i for i, m in enumerate(mapped) if not m), len(mapped))
            if self.home_mapped < len(mapped):  # keep the prefix invariant: nothing mapped past the gap
                self.arena.backend.unmap(self.home_base, self.home_mapped, len(mapped) - self.home_mapped)
            self.arena.note_mapped()

    def _map_slots(self) -> None:
        if self.slots_mapped or not self.slot_chunks:
            return
        self.arena.make_room(self, self.slot_chunks)
        try:
            self._map(self.slot_base, 0, self.slot_chunks)
        except BaseException:
            self.arena.backend.unmap(self.slot_base, 0, self.slot_chunks)  # all or nothing
            raise
        self.slots_mapped = True
        self.arena.note_mapped()

    def _upload_missing(self) -> None:
        e = self.engine
        todo = [i for i, ok in enumerate(self.loaded) if not ok]
        if not todo:
            return
        stream = e._copy_stream
        for i in todo:
            s, off = self.host.placement[i]
            n = self.host.unit_nbytes[i]
            src = self.host.slabs[s].base[off: off + n]
            dst = self.home[self.home_offsets[i]: self.home_offsets[i] + n]
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            if self._placed:
                self.arena.restored_bytes += n
            else:
                self.arena.placed_bytes += n
        if stream is not None:
            torch.cuda.current_stream(e.device).wait_stream(stream)
        for i in todo:
            for (_, p), v in zip(self.units[i].params, self.home_views[i]):
                set_data(p, v)
            self.loaded[i] = True

    # -- calls -------------------------------------------------------------------------------------
    def call_started(self) -> None:
        """Maps what was evicted, copies evicted units back, resumes the slots: the call finds every
        resident weight at its address."""
        with self.arena.lock:
            self.busy += 1
            try:
                self.last_call = next(_clock)
                self.arena.enter_phase(self)
                auto = self.arena.auto
                if auto is not None and self.name not in auto.activations and self._peak is None:
                    from ..autobudget import CallPeak

                    self._peak = CallPeak(self.engine.device)
                restored = False
                if self.home_base is not None and (self.home_mapped < self.home_chunks or not all(self.loaded)):
                    self._map_home()
                    self._upload_missing()
                    restored = True
                if self.slot_base is not None and not self.slots_mapped:
                    self._map_slots()
                    self.engine.scheduler.resume()
                    restored = True
                self.restores += restored
                if self._peak is not None:
                    self._peak.start()  # after the restore: what the call itself allocates
            except BaseException:
                self.busy -= 1
                raise

    def call_finished(self) -> None:
        e = self.engine
        with self.arena.lock:  # the fence of this call is in place before it can be evicted
            if e.device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(e.device))
                self._fence = ev
            if self._peak is not None and self.arena.auto is not None:
                act = self._peak.finish()  # the first call's activations (waits for it, once)
                # only a whole call that returned counts (a block called on its own, or an interrupted
                # call, would understate them): else the next call measures again
                if act is not None and e.scheduler.last_call_clean and e.scheduler.depth == 0:
                    self.arena.auto.activations[self.name] = act
                self._peak = None
            self.busy = max(0, self.busy - 1)

    def _wait_idle(self) -> None:
        """This member's last call and every copy queued for it are done (its own events and stream)."""
        if self._fence is not None:
            self._fence.synchronize()
        transport = self.engine.transport
        if transport is not None:
            transport.drain()  # its copies and, with a codec, the decodes into the slots
        stream = self.engine._copy_stream
        if stream is not None:
            stream.synchronize()  # the restores (torch copies on the copy stream)

    def evict(self, want: int) -> int:
        """Unmaps up to ``want`` chunks (slots first, then the home range's tail); returns how many."""
        got = 0
        if want <= 0 or self.mapped_chunks() == 0 or (self.host is None and self.units):
            return 0  # without host copies (a private arena's only member) nothing can come back
        self._wait_idle()
        if self.slots_mapped and self.slot_chunks:
            self.engine.scheduler.suspend()  # what is in flight is forgotten; the next call refetches
            self.slots_mapped = False  # even if the unmap fails part-way: the next call maps them again
            self.arena.backend.unmap(self.slot_base, 0, self.slot_chunks)
            got += self.slot_chunks
        if got < want and self.home_mapped:
            edited: bool | None = None
            keep = max(0, self.home_mapped - (want - got))
            cut = keep * self.chunk
            for i, off in enumerate(self.home_offsets):
                if self.loaded[i] and off + self.host.unit_nbytes[i] > cut:
                    if edited is None:
                        edited = self.engine.resident_edits_pending()
                    if edited:  # to the host copy it is restored from
                        self.engine.slots.write_back(i)
                    for (_, p), v in zip(self.units[i].params, self.host.host_views[i]):
                        set_data(p, v)
                    self.loaded[i] = False
            before, self.home_mapped = self.home_mapped, keep  # the units past the cut are unloaded already
            self.arena.backend.unmap(self.home_base, keep, before - keep)
            got += before - keep
        return got

    # -- detach ------------------------------------------------------------------------------------
    def close(self, orig_device: dict[int, torch.device]) -> None:
        """Points the resident units back at their own memory, frees both ranges, leaves the arena.
        Whatever fails, the member leaves (its state reset); the first error is raised after."""
        with self.arena.lock:
            try:
                self._wait_idle()
                self._park_resident(orig_device)  # nothing points into the ranges from here
                if self.host is not None:
                    self.host.release(orig_device, keep_warm=False)
                    self.host = None
            finally:
                self._park_resident(orig_device)
                self.home_views, self.home, self.slot_tensor = [], None, None
                bases, self.home_base, self.slot_base = (self.home_base, self.slot_base), None, None
                self.home_mapped, self.slots_mapped, self.loaded, self.busy = 0, False, [], 0
                error: BaseException | None = None
                for base in bases:
                    if base is None:
                        continue
                    try:
                        self.arena.backend.free_range(base)
                    except DdoError as exc:  # one retry: a deferred error of someone else may have come first
                        try:
                            self.arena.backend.free_range(base)
                        except DdoError:
                            error = error or exc
                self.arena.leave(self)
                if error is not None:
                    raise error

    def _park_resident(self, orig_device: dict[int, torch.device]) -> None:
        """Points every resident unit's parameters at its host copy (always valid while it exists), or,
        without host copies (a private arena), gives them their own memory on their original device,
        copied from the arena: either way nothing points into the ranges afterwards."""
        from ..units import own_copy

        if self.host is not None and self.host.host_views:
            for i, unit in enumerate(self.units):
                for (_, p), v in zip(unit.params, self.host.host_views[i]):
                    set_data(p, v)
            return
        if self.home is None:
            return
        lo, hi = self.home.data_ptr(), self.home.data_ptr() + self.home.numel()
        for unit in self.units:
            for _, p in unit.params:
                if lo <= p.data_ptr() < hi:
                    p.data = own_copy(p.data, orig_device.get(id(p), torch.device("cpu")))

    def figures(self) -> dict[str, Any]:
        return dict(
            home_bytes=self.home_nbytes,
            slot_bytes=self.slot_nbytes,
            fixed_bytes=self.fixed_bytes,
            mapped_bytes=self.mapped_chunks() * self.chunk,
            resident_units=len(self.units),
            host_copy_bytes=self.host.nbytes if self.host is not None else 0,
            loaded_units=sum(self.loaded),
            restores=self.restores,
        )


class ArenaSlots(TorchSlots):
    """The vmm route's device side: the engine's slots in the member's slot range, its resident units
    in the member's home range, both in the arena; the per-call hooks restore what was evicted."""

    places_resident = True

    def graph_blocker(self) -> str | None:
        return ("the vmm arena maps pages and restores evicted units at a call's start, which a CUDA graph "
                "cannot replay: use route='linear' for graph=True")

    def __init__(self, engine: Any, arena: Arena, name: str, extra_fixed: int = 0):
        super().__init__(engine.device)
        self.engine = engine
        self.member = Member(arena, engine, name)
        self.member.fixed_bytes = engine.unit_plan.base_bytes + extra_fixed  # a codec's landing buffers too
        n_slots = max(1, min(engine.plan.slots, len(engine.streamed))) if engine.streamed else 0
        slot_bytes = max(engine.layout_bytes) if engine.streamed else 0
        self.member.lay_out(engine.resident_units, n_slots * slot_bytes)

    def before_place(self) -> None:
        self.member.arena.join(self.member)

    def place_resident(self, units: list[Unit], loader: Any) -> None:
        self.member.place(loader)

    def ready(self) -> None:
        self.member.busy = max(0, self.member.busy - 1)  # attached: evictable between its calls

    def replan_budget(self, planned_with_whole_arena: bool) -> int | None:
        """``Arena("auto")``: the budget to plan this component again with, once, after its first call
        (its phase's budget less the others' fixed bytes), when it planned with the whole arena and that
        is at least 10 % more than what it planned with; else ``None``."""
        from ..autobudget import REPLAN_GAIN

        arena, m = self.member.arena, self.member
        if (arena.auto is None or not planned_with_whole_arena or m.name not in arena.auto.activations
                or not self.engine.streamed):  # all resident already: a larger budget changes nothing
            return None
        new = arena.auto.phase_budget(m.name) - (arena.fixed_bytes - m.fixed_bytes)
        return new if new >= self.engine.budget * (1 + REPLAN_GAIN) else None

    def enter_own_phase(self) -> None:
        """Sets the arena's budget to this member's phase (before it is planned again with it)."""
        self.member.arena.enter_phase(self.member)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return self.member.build_slots()[:nbytes]

    def edit_groups(self) -> list[list[tuple[str, nn.Parameter]]]:
        """The resident units, when the arena keeps host copies of them (it evicts and restores them)."""
        m = self.member
        return [u.params for u in m.units] if m.host is not None else []

    def host_copy(self, i: int, j: int) -> torch.Tensor | None:
        m = self.member
        return m.host.host_views[i][j] if m.host is not None and m.loaded[i] else None

    def write_back(self, i: int) -> None:
        """A resident unit edited in the arena: its host copy takes the edit (it is restored from it)."""
        m = self.member
        if m.host is None or not m.loaded[i]:
            return  # evicted: the edit went to the host copy itself
        with torch.no_grad():
            for (_, p), host, home in zip(m.units[i].params, m.host.host_views[i], m.home_views[i]):
                now = get_data(p)
                if (now.data_ptr() != home.data_ptr() or now.stride() != home.stride()) and now.shape == home.shape \
                        and now.dtype == home.dtype:  # pointed elsewhere (p.set_(t)): its values, at its address
                    home.copy_(now)
                    set_data(p, home)
                host.copy_(home)

    def call_started(self) -> None:
        self.member.call_started()

    def call_finished(self) -> None:
        self.member.call_finished()

    def close(self) -> None:
        super().close()
        if self.member in self.member.arena.members or self.member.host is not None:
            self.member.close(self.engine.orig_device)
