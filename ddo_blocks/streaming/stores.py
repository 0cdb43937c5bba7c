"""The host side of a streamed component: where each streamed unit's bytes live between calls, how a
fetch is described to the transport, and where a unit's parameters park after it ran.

- :class:`HostSlabs` (linear route): every streamed unit packed into host slabs, page-locked
  (``PINNED_SLABS``: one asynchronous copy per unit straight into its slot) or pageable
  (``PAGEABLE_STAGED``: the transport's staging thread moves each unit through a bounded ring of
  small page-locked buffers).
- :class:`FileStore` (NVMe route): a static RAM cache (host slabs of the units ``ddo-core``'s cache
  planner keeps within ``ram_budget``: the pass is cyclic, so a fixed retained set beats LRU); the
  other units are read from their safetensors files on every call: each is registered with the
  transport as a coalesced, aligned read plan; a fetch is a staging job that the Rust staging thread
  runs with its reader pool (``O_DIRECT`` where allowed) into a bounded ring of page-locked
  buffers, then copies to the slot. Between calls their parameters are placeholders of the right
  shape and dtype that hold no RAM (one shared element, NaN for floating dtypes, so a use outside
  the unit's hooks cannot pass for the weights). Every call starts with a check of the checkpoint's
  files (inode, size, modification and change times): a replaced, rewritten or truncated file
  raises ``CheckpointError`` instead of running with wrong weights. Removal reads the disk units'
  weights back into ordinary memory, so the module keeps working.

A store is built by the streaming engine (``store(engine)``) once the plan is known; it reads the
engine's units, geometry, preset, device and loader, and never touches slots or hooks.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch
from torch import nn

from .. import _native
from ..budget import fmt_bytes
from ..errors import CheckpointError, ConfigError, OffloadMemoryError
from ..routes.spec import HostMode, Preset
from ..units import tensor_nbytes
from . import bandwidth
from .slabs import SlabSet
from .slabs import _alloc as slabs_alloc

READ_GAP_BYTES = 64 << 10
"""Gaps between a unit's tensors in a file up to this size are read through (one read, not two)."""

READ_ALIGN = 4096
"""ddo_cuda reader::ALIGN: O_DIRECT offsets, lengths and buffers."""


class UnitStore(Protocol):
    """What the streaming engine asks of a host side."""

    lost: list[str]
    """Parameters a failed removal could not restore (left as NaN placeholders)."""

    device_bytes: int
    """Device bytes the store holds beside the slots (counted in the engine's ``gpu_bytes``)."""

    def build(self) -> None:
        """Packs or registers every streamed unit's bytes; parameters point at their host side."""

    def open_transport(self, n_slots: int, slot_bytes: int, offsets: list[list[int]], copy_stream: int) -> Any:
        """The ``_native.Transport`` that fetches this store's units, with anything it must know."""

    def fetch(self, transport: Any, u: int, slot: int, dst: int) -> None:
        """Starts the copy of streamed unit ``u`` into ``slot`` at device address ``dst``."""

    def host_views(self, u: int) -> list[torch.Tensor]:
        """Where unit ``u``'s parameters point between its runs."""

    def call_started(self, transport: Any) -> None: ...

    def call_finished(self, transport: Any) -> None: ...

    def before_release(self) -> CheckpointError | None:
        """Brings back what only the store holds (disk units), before anything is detached (on a
        removal; a failed attach keeps the placeholders). Raises to keep the offload in place (it can
        be retried); returns an error to raise after the removal."""

    def release(self, orig_device: dict[int, torch.device], keep_warm: bool) -> None:
        """Gives every parameter its own memory on its original device and frees the store."""

    def closed(self, transport: Any) -> None:
        """Takes the transport's final figures before it is closed."""

    def sim_args(self) -> tuple:
        """Extra simulator arguments (units read from disk and the disk's rate), or none."""

    def disk_figures(self) -> tuple[float, int] | None:
        """The disk's read rate (B/s) and the bytes read from it per call, for a store that reads."""

    def report_sections(self, transport: Any) -> dict[str, dict[str, Any]]: ...

    @property
    def slabs(self) -> SlabSet | None: ...


class InMemoryStore:
    """The parts of a :class:`UnitStore` that are the same for every store whose units all sit in
    host memory (``HostSlabs``, ``coded.CodedSlabs``): nothing to check per call, nothing to bring
    back before a removal, no disk in the simulation or the roofline, no device memory of its own."""

    device_bytes = 0
    """Device bytes the store holds beside the slots (the codec's landing buffers)."""

    def call_started(self, transport: Any) -> None:
        pass

    def call_finished(self, transport: Any) -> None:
        pass

    def before_release(self) -> CheckpointError | None:
        return None

    def closed(self, transport: Any) -> None:
        pass

    def sim_args(self) -> tuple:
        return ()

    def disk_figures(self) -> tuple[float, int] | None:
        return None


def _slab_views(slabs: SlabSet | None) -> list[torch.Tensor]:
    return [v for unit in (slabs.host_views if slabs else []) for v in unit]


class HostSlabs(InMemoryStore):
    """Every streamed unit in host slabs (the linear route)."""

    parked_where = "in host memory"

    def __init__(self, engine: Any):
        self.engine = engine
        preset: Preset = engine.preset
        self.pin = engine.device.type == "cuda" and preset.host is HostMode.PINNED_SLABS
        self.staged = preset.host is HostMode.PAGEABLE_STAGED
        self.slabs: SlabSet | None = None
        self.lost: list[str] = []

    def build(self) -> None:
        e = self.engine
        self.slabs = SlabSet(e.streamed, pin=self.pin, ordinal=e.device.index or 0, keep_warm=e.preset.keep_warm)
        self.slabs.pack(e.loader)

    def open_transport(self, n_slots: int, slot_bytes: int, offsets: list[list[int]], copy_stream: int) -> Any:
        p, e = self.engine.preset, self.engine
        staging = ((p.staging_buffers, p.staging_buffer_mib << 20, p.staging_threads, True) if self.staged
                   else None)
        return _native.Transport(e.device.type, e.device.index or 0, n_slots, copy_stream, staging,
                                 piece_bytes=p.staging_piece_kib << 10)

    def fetch(self, transport: Any, u: int, slot: int, dst: int) -> None:
        transport.fetch(slot, dst, self.slabs.unit_ptr(u), self.slabs.unit_nbytes[u])

    def graph_blocker(self) -> str | None:
        p = self.engine.preset
        if self.staged:
            return (f"preset {p.name!r} copies through a staging ring on a host thread, which a CUDA graph cannot "
                    "replay: use preset='one_shot_fast'")
        if not self.pin:
            return (f"preset {p.name!r} keeps the host slabs pageable; a CUDA graph copies from page-locked memory "
                    "only: use preset='one_shot_fast'")
        return None

    def host_views(self, u: int) -> list[torch.Tensor]:
        return self.slabs.host_views[u]

    def all_views(self) -> list[torch.Tensor]:
        return _slab_views(self.slabs)

    def release(self, orig_device: dict[int, torch.device], keep_warm: bool) -> None:
        if self.slabs is not None:
            self.slabs.release(orig_device, keep_warm=keep_warm)
            self.slabs = None

    def report_sections(self, transport: Any) -> dict[str, dict[str, Any]]:
        slabs = self.slabs
        return {"plan": {"host_borrowed_bytes": slabs.borrowed_bytes if slabs is not None else 0}}


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``p``'s shape and dtype backed by one element (NaN when floating)."""
    one = torch.full((), float("nan"), dtype=p.dtype) if p.is_floating_point() else torch.zeros((), dtype=p.dtype)
    hollow = one.expand(p.shape)
    hollow._ddo_placeholder = True  # the edit watch refuses every read of a parameter parked on it
    return hollow


class FileStore:
    """Streamed units from a RAM cache or from their safetensors files (the NVMe route), or with a
    ``codec`` from a coded side file next to them (``streaming.sidefile``): read coded, copied into
    one device staging buffer of the largest coded unit, decoded into the slot on the copy stream."""

    def graph_blocker(self) -> str | None:
        return "the NVMe route reads its units on host threads, which a CUDA graph cannot replay"

    @property
    def parked_where(self) -> str:
        return ("read from the checkpoint's files (route='nvme')" if self.codec == "off"
                else f"coded (codec={self.requested_codec!r}) in a side file or host memory (route='nvme')")

    def __init__(self, engine: Any, *, ram_budget: int | None, ram_auto: bool, codec: str = "off",
                 codec_dir: Path | None = None, staged_reserve: int = 0, requested_codec: str | None = None):
        self.engine = engine
        e = engine
        self.codec = codec
        self.requested_codec = requested_codec or codec
        self.codec_dir = codec_dir
        self.staged_reserve = staged_reserve
        """Device bytes the plan reserved for the staging buffer (``sidefile.reserve_bytes``): a unit coded
        larger is read from the checkpoint as stored."""
        self.side: Any = None  # sidefile.SideFile once built
        self._staged_unit: dict[int, int] = {}  # streamed index -> the transport's staged coded unit
        self._host_coded: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        """Streamed index -> (storage, buffer, page-locking) of a RAM-cached unit kept coded."""
        self._slab_index: dict[int, int] = {}  # streamed index -> its unit in the (uncoded) RAM cache's SlabSet
        self._side_unit: dict[int, tuple[Any, list[tuple[int, int, int]]]] = {}
        """Streamed index -> its layout from the side file's blobs and their reads (``SideFile.unit``)."""
        self.staged: torch.Tensor | None = None
        preset: Preset = e.preset
        self.loader = e.loader
        self.slabs: SlabSet | None = None
        self.lost: list[str] = []
        streamed_total = sum(e.unit_bytes[u.index] for u in e.streamed)
        if ram_budget is None:
            available = psutil.virtual_memory().available
            ram_budget = min(streamed_total, max(0, available // 2 - preset.staging_bytes)) if ram_auto else 0
        self.ram_budget = ram_budget
        self.disk_bytes_per_s: float | None = None
        self.disk_probe: str | None = None
        self.cache_plan: _native.RamCachePlan | None = None
        self.cached_units: list[Any] = []
        self.disk_units: list[int] = []  # indices into engine.streamed
        self._cache_index: dict[int, int] = {}  # streamed index -> index in the cache's SlabSet
        self._file_unit: dict[int, int] = {}  # streamed index -> transport file unit
        self._hollow_views: dict[int, list[torch.Tensor]] = {}
        self._disk_params: list[tuple[nn.Parameter, Any]] = []
        self.staging_buffer_bytes = 0
        self._file_ids: dict[str, int] = {}
        self._direct_files: dict[str, bool] = {}  # as last asked: a read refused O_DIRECT turns it off
        self.disk_call_bytes: list[int] = []
        self._disk_bytes0 = 0
        self._final_disk_stats = (0, 0)
        if not e.streamed:
            return
        self.disk_bytes_per_s, self.disk_probe = bandwidth.disk_bytes_per_s(
            self._largest_file(), threads=preset.staging_threads
        )
        self.coded_ratio = 1.0
        """Coded over stored bytes of the disk units (estimated until the side file is written)."""
        sizes = list(e.unit_bytes)
        if codec != "off":
            from . import coded

            # what a unit takes in the RAM cache and on the disk and the link: its coded estimate
            sizes = [min(c, r) for c, r in zip(coded.coded_estimate(e.units, codec), e.unit_bytes)]
            self.coded_ratio = (sum(sizes[u.index] for u in e.streamed)
                                / max(1, sum(e.unit_bytes[u.index] for u in e.streamed)))
        compute = bandwidth.compute_bytes_per_s(e.device, e.link_bytes_per_s)
        self.cache_plan = _native.plan_ram_cache(
            sizes,
            unit_compute_s=[b / compute for b in e.unit_bytes],
            resident=e.plan.resident,
            slots=max(1, e.plan.slots),
            ram_budget_bytes=ram_budget,
            link_bytes_per_s=e.link_bytes_per_s,
            disk_bytes_per_s=self.disk_bytes_per_s,
        )
        cached = self.cache_plan.cached
        for u, unit in enumerate(e.streamed):
            if cached[unit.index]:
                self._cache_index[u] = len(self.cached_units)
                self.cached_units.append(unit)
            else:
                self.disk_units.append(u)
        self._check_sources()
        if codec != "off" and not any(p.dtype == torch.bfloat16 for u in e.streamed for _, p in u.params):
            raise ConfigError(
                f"codec={codec!r} codes bf16 weights, and the streamed weights of this checkpoint are "
                f"{sorted({str(p.dtype) for u in e.streamed for _, p in u.params})}: pass codec='off'"
            )

    def _largest_file(self) -> Path:
        per_file: dict[Path, int] = defaultdict(int)
        for unit in self.engine.streamed:
            for _, p in unit.params:
                src = self.loader.source(p)
                if src is not None:
                    per_file[src.path] += src.nbytes
        return max(per_file, key=lambda f: per_file[f])

    def _check_sources(self) -> None:
        """Disk units (and with a codec every streamed unit: the side file codes the checkpoint's tensors)
        are copied from the files as stored: each tensor must match its source."""
        for u in (range(len(self.engine.streamed)) if self.codec != "off" else self.disk_units):
            for name, p in self.engine.streamed[u].params:
                src = self.loader.source(p)
                if src is None:
                    raise ConfigError(f"route='nvme': parameter {name!r} has no tensor in the checkpoint to read")
                if src.dtype != p.dtype or src.nbytes != tensor_nbytes(p):
                    raise ConfigError(
                        f"route='nvme' streams tensors from the files as stored, but {name!r} is {src.dtype} in "
                        f"{src.path.name} and {p.dtype} in the model; pass dtype=None to from_pretrained (keep "
                        "the file's dtype), convert the checkpoint, or use route='linear'"
                    )

    # -- attach ------------------------------------------------------------------------------------
    def build(self) -> None:
        e = self.engine
        if self.codec != "off" and e.streamed:
            from . import sidefile

            self.side = sidefile.prepare(self.loader.checkpoint, self.codec, directory=self.codec_dir)
            coded_bytes = raw_bytes = 0
            for u in range(len(e.streamed)):
                unit = self.side.unit([(self.loader.source(p), off)
                                       for (_, p), off in zip(e.streamed[u].params, e.offsets[u])])
                if unit is not None and (unit[0].nbytes <= self.staged_reserve or e.device.type != "cuda"):
                    self._side_unit[u] = unit
                    if u not in self._cache_index:
                        coded_bytes += sum(n for _, n, _ in unit[1])
                        raw_bytes += e.unit_bytes[e.streamed[u].index]
            if raw_bytes:
                self.coded_ratio = coded_bytes / raw_bytes
            self._cache_coded()
        raw_cached = [unit for u, unit in enumerate(e.streamed) if u in self._cache_index and u not in self._host_coded]
        self._slab_index = {u: i for i, u in enumerate(u for u in range(len(e.streamed))
                                                       if u in self._cache_index and u not in self._host_coded)}
        if raw_cached:
            pin = e.device.type == "cuda"
            self.slabs = SlabSet(raw_cached, pin=pin, ordinal=e.device.index or 0, keep_warm=False)
            self.slabs.pack(self.loader)
        for u in [*self.disk_units, *self._host_coded]:
            views = []
            for _, p in e.streamed[u].params:
                src = self.loader.take(p)
                hollow = _placeholder(p)
                self._disk_params.append((p, src))
                p.data = hollow  # frees the unread buffer from unmeta()
                views.append(hollow)
            self._hollow_views[u] = views

    def _cache_coded(self) -> None:
        """The RAM cache's units that the side file holds, kept coded in host memory (page-locked on a
        GPU): read from the side file, their parameters placeholders like the disk units'."""
        e, side = self.engine, self.side
        for u in self._cache_index:
            if u not in self._side_unit:
                continue
            layout, reads = self._side_unit[u]
            storage, buf = slabs_alloc(layout.nbytes)
            _native.read_file_into(side.path, [(off, n, buf.data_ptr() + at) for off, n, at in reads])
            reg = (_native.HostRegistration(storage, buf.data_ptr(), layout.nbytes, e.device.index or 0)
                   if e.device.type == "cuda" and layout.nbytes else None)
            self._host_coded[u] = (storage, buf, reg)

    def open_transport(self, n_slots: int, slot_bytes: int, offsets: list[list[int]], copy_stream: int) -> Any:
        e, pre = self.engine, self.engine.preset
        # a ring buffer holds at most one unit's aligned reads: small models do not get 4 x 64 MiB
        unit_read = -(-(slot_bytes + 2 * READ_ALIGN) // (1 << 20)) << 20
        self.staging_buffer_bytes = min(pre.staging_buffer_mib << 20, unit_read)
        staging = (pre.staging_buffers, self.staging_buffer_bytes, pre.staging_threads, True)
        transport = _native.Transport(e.device.type, e.device.index or 0, n_slots, copy_stream, staging,
                                      stage_host=False)
        try:
            file_ids: dict[Path, int] = {}
            for u in self.disk_units:
                pieces = []
                for (_, p), off in zip(e.streamed[u].params, offsets[u]):
                    src = self.loader.source(p)
                    if src.path not in file_ids:
                        file_ids[src.path] = transport.open_file(str(src.path))
                    pieces.append((file_ids[src.path], src.offset, src.nbytes, off))
                self._file_unit[u] = transport.add_file_unit(pieces, READ_GAP_BYTES)
            self._file_ids = {p.name: i for p, i in file_ids.items()}
            if self._side_unit:
                side = self.side
                fid = transport.open_file(str(side.path))
                self._file_ids[side.path.name] = fid
                # one buffer for every coded read: the copy stream orders each unit's decode before
                # the next unit's copies into it
                span = max(layout.nbytes for layout, _ in self._side_unit.values())
                self.staged = torch.empty(max(span, 1), dtype=torch.uint8, device=e.device)
                for u, (layout, reads) in self._side_unit.items():
                    if u not in self._host_coded:  # read from the side file each call
                        self._file_unit[u] = transport.add_file_unit(
                            [(fid, off, n, at) for off, n, at in reads], READ_GAP_BYTES)
                    self._staged_unit[u] = transport.add_staged_unit(layout)
        except BaseException:
            transport.close()
            raise
        return transport

    # -- the pipeline ------------------------------------------------------------------------------
    def fetch(self, transport: Any, u: int, slot: int, dst: int) -> None:
        su = self._staged_unit.get(u)
        hc = self._host_coded.get(u)
        if hc is not None:
            transport.fetch_host_coded(slot, dst, su, hc[1].data_ptr(), self.staged.data_ptr())
        elif su is not None:
            transport.fetch_file_coded(slot, dst, self._file_unit[u], su, self.staged.data_ptr())
        elif u in self._slab_index:
            ci = self._slab_index[u]
            transport.fetch(slot, dst, self.slabs.unit_ptr(ci), self.slabs.unit_nbytes[ci])
        else:
            transport.fetch_file(slot, dst, self._file_unit[u])

    def host_views(self, u: int) -> list[torch.Tensor]:
        ci = self._slab_index.get(u)
        return self.slabs.host_views[ci] if ci is not None else self._hollow_views[u]

    def all_views(self) -> list[torch.Tensor]:
        return _slab_views(self.slabs)

    def call_started(self, transport: Any) -> None:
        if not self._disk_params:
            return
        self._disk_bytes0 = transport.disk_stats()[1] if transport is not None else 0
        try:
            self.loader.checkpoint.check_unchanged()  # one stat per file: a changed file stops the call
            if self._side_unit:
                self.side.check_unchanged()
        except CheckpointError as exc:
            raise CheckpointError(
                f"{type(self.engine.module).__name__} is offloaded with route='nvme' and reads weights from its "
                f"files on every call, but {exc}. The offload cannot go on: remove() it and load the model again"
            ) from exc

    def call_finished(self, transport: Any) -> None:
        if self._disk_params and transport is not None:
            self.disk_call_bytes.append(transport.disk_stats()[1] - self._disk_bytes0)

    # -- removal: disk units come back into ordinary memory ----------------------------------------
    def before_release(self) -> CheckpointError | None:
        disk, self._disk_params = self._disk_params, []
        if not disk or not self.engine.attached:
            # an attach that failed: the module (from_pretrained's, about to be discarded) keeps its
            # placeholders; reading a model larger than RAM back would turn the error into an OOM
            return None
        try:
            self.loader.checkpoint.check_unchanged()
            pairs = [(src, torch.empty(p.shape, dtype=p.dtype)) for p, src in disk]
            self.loader.read_many(pairs)
            for (p, _), (_, t) in zip(disk, pairs):
                p.data = t  # the engine then moves it to its original device
        except CheckpointError as exc:
            names = {id(p): n for n, p in self.engine.module.named_parameters()}
            for p, _ in disk:
                self.engine.orig_device.pop(id(p), None)  # stays a NaN placeholder: unusable rather than wrong
                self.lost.append(names.get(id(p), "?"))
            return CheckpointError(
                f"the offload of {type(self.engine.module).__name__} was removed, but {len(disk)} tensors read from "
                f"disk could not be restored ({exc}); they were left as empty placeholders (NaN): load the model again"
            )
        except BaseException as exc:
            # nothing is detached yet: the offload stays in place and working, remove() can be retried
            self._disk_params = disk
            if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError)
                                                 and "can't allocate memory" in str(exc)):  # PyTorch's CPU allocator
                nbytes = sum(p.numel() * p.element_size() for p, _ in disk)
                raise OffloadMemoryError(
                    f"removing the offload of {type(self.engine.module).__name__} reads the {len(disk)} tensors "
                    f"kept on disk back into host RAM ({fmt_bytes(nbytes)}), and that allocation failed ({exc}). "
                    "The offload is still in place and the module still runs: free host memory and call "
                    "remove() again, or keep the offload"
                ) from exc
            raise
        return None

    @property
    def device_bytes(self) -> int:
        """The coded reads' device staging buffer (on a GPU)."""
        return self.staged.numel() if self.staged is not None and self.staged.device.type == "cuda" else 0

    def release(self, orig_device: dict[int, torch.device], keep_warm: bool) -> None:
        self._hollow_views = {}
        self.staged = None
        for _, _, reg in self._host_coded.values():
            if reg is not None:
                reg.close()
        self._host_coded = {}
        if self.slabs is not None:
            self.slabs.release(orig_device, keep_warm=False)
            self.slabs = None

    def closed(self, transport: Any) -> None:
        self._final_disk_stats = transport.disk_stats()

    def disk_figures(self) -> tuple[float, int] | None:
        """The disk's read rate (B/s) and the bytes read from it per call."""
        return (self.disk_bytes_per_s, self.disk_bytes) if self.disk_bytes_per_s else None

    def sim_args(self) -> tuple:
        if self.disk_bytes_per_s is None:
            return ()
        from_disk = self.cache_plan.from_disk if self.cache_plan else [False] * len(self.engine.units)
        return from_disk, self.disk_bytes_per_s / self.coded_ratio  # a coded unit reads fewer bytes

    # -- report ------------------------------------------------------------------------------------
    @property
    def cached_bytes(self) -> int:
        """Host bytes of the RAM cache: coded where the side file holds the unit."""
        e = self.engine
        return sum(self._host_coded[u][1].numel() if u in self._host_coded else e.unit_bytes[e.streamed[u].index]
                   for u in self._cache_index)

    @property
    def disk_bytes(self) -> int:
        """Bytes read from disk per call (before alignment): coded where the side file holds the unit."""
        e = self.engine
        return sum(sum(n for _, n, _ in self._side_unit[u][1]) if u in self._side_unit
                   else e.unit_bytes[e.streamed[u].index] for u in self.disk_units)

    def report_sections(self, transport: Any) -> dict[str, dict[str, Any]]:
        stats = transport.disk_stats() if transport is not None else self._final_disk_stats
        if transport is not None:
            self._direct_files = {n: bool(transport.file_is_direct(i)) for n, i in self._file_ids.items()}
        last = self.disk_call_bytes[-1] if self.disk_call_bytes else None
        sections = {
            "plan": {
                "ram_budget_bytes": self.ram_budget,
                "cached_units": len(self.cached_units),
                "cached_bytes": self.cached_bytes,
                "disk_units": len(self.disk_units),
                "disk_bytes": self.disk_bytes,
                "staging_bytes": self.engine.preset.staging_buffers * self.staging_buffer_bytes,
                "predicted_step_s": self.cache_plan.predicted_step_s if self.cache_plan
                else self.engine.plan.predicted_step_s,
            },
            "setup": {
                "disk_probe": self.disk_probe,
                "o_direct_files": ", ".join(f"{n}: {'yes' if d else 'no'}" for n, d in self._direct_files.items())
                or None,
            },
            "runtime": {
                "file_fetches": stats[0],
                "disk_total_bytes": stats[1],
                "disk_call_bytes": last,
            },
        }
        if self.codec != "off":
            sections["codec"] = self._codec_section()
        return sections

    def _codec_section(self) -> dict[str, Any]:
        e, side = self.engine, self.side
        disk = [u for u in self.disk_units if u in self._side_unit]
        raw = sum(e.unit_bytes[e.streamed[u].index] for u in disk)
        coded_bytes = sum(n for u in disk for _, n, _ in self._side_unit[u][1])
        return {
            "requested": self.requested_codec,
            "codec": self.codec,
            "side_file": str(side.path) if side else None,
            "side_file_bytes": side.nbytes if side else 0,
            "side_file_reused": side.reused if side else None,
            "encode_s": side.encode_s if side else 0.0,
            "coded_units": len(disk),
            "cached_coded_units": len(self._host_coded),
            "cached_coded_bytes": sum(buf.numel() for _, buf, _ in self._host_coded.values()),
            "disk_units_read_as_stored": sum(u not in self._side_unit for u in self.disk_units),
            "raw_bytes": raw,
            "coded_bytes": coded_bytes,
            "ratio": coded_bytes / raw if raw else None,
            "staging_device_bytes": self.device_bytes,
            "staging_reserve_bytes": self.staged_reserve,
        }
