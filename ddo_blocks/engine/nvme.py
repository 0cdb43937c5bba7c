"""The NVMe route: models larger than RAM, streamed from their safetensors files.

The linear engine does everything it does for the linear route (units, device plan, K slots,
events, hooks, cyclic prefetch, order learning); this engine only changes where a streamed unit's
bytes come from:

- **RAM cache.** ``ddo-core``'s cache planner picks, once, the streamed units kept in host RAM
  within ``ram_budget`` (the pass is cyclic, so a fixed retained set beats LRU). They live in host
  slabs exactly as on the linear route (page-locked on CUDA) and are copied straight to their slot.
- **Disk units.** The others are read from their files on every call: each unit is registered with
  the transport as a coalesced, aligned read plan over its files; a fetch is a staging job that
  the Rust staging thread runs with its reader pool (``O_DIRECT`` where allowed) into a bounded
  ring of page-locked buffers, then copies to the slot. Reads, copies and compute overlap; the
  GIL is released and Python never waits except for a unit that has not arrived. Between calls
  their parameters are placeholders of the right shape and dtype that hold no RAM (one shared
  element, NaN for floating dtypes, so a use outside the unit's hooks cannot pass for the weights).
- **Changed files.** Every call starts with a stat of the checkpoint's files (size and
  modification time); a replaced or truncated file raises ``CheckpointError`` instead of running
  with wrong weights. A file truncated in the middle of a call fails the read (also
  ``CheckpointError``).
- **Removal** reads the disk units' weights into ordinary memory, so the module keeps working.

On ``device="cpu"`` the same staging jobs run with ordinary buffers and memcpy into host slots.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

from .. import _native
from ..budget import fmt_bytes
from ..errors import CheckpointError, ConfigError, DdoError, OffloadMemoryError
from ..presets import Preset
from ..units import span_nbytes, tensor_nbytes
from . import bandwidth
from .linear import LinearEngine
from .slabs import SlabSet

READ_GAP_BYTES = 64 << 10
"""Gaps between a unit's tensors in a file up to this size are read through (one read, not two)."""


def _native_align() -> int:
    return 4096  # ddo_cuda reader::ALIGN: O_DIRECT offsets, lengths and buffers


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``p``'s shape and dtype backed by one element (NaN when floating)."""
    one = torch.full((), float("nan"), dtype=p.dtype) if p.is_floating_point() else torch.zeros((), dtype=p.dtype)
    return one.expand(p.shape)


class NvmeEngine(LinearEngine):
    """Streams one component's units through K device slots, from a RAM cache or from disk.
    Created by ``ddo_blocks.from_pretrained(..., route="nvme")``."""

    def __init__(self, module: nn.Module, preset: Preset, budget: int | None, device: torch.device, *,
                 loader: Any, ram_budget: int | None, ram_auto: bool, units: str = "auto"):
        super().__init__(module, preset, budget, device, loader=loader, units=units)
        streamed_total = sum(self.unit_bytes[u.index] for u in self.streamed)
        if ram_budget is None:
            available = psutil.virtual_memory().available
            ram_budget = min(streamed_total, max(0, available // 2 - preset.staging_bytes)) if ram_auto else 0
        self.ram_budget = ram_budget
        self.disk_bytes_per_s: float | None = None
        self.disk_probe: str | None = None
        self.cache_plan: dict[str, Any] | None = None
        self.cached_units = []
        self.disk_units: list[int] = []  # indices into self.streamed
        self._cache_index: dict[int, int] = {}  # streamed index -> index in the cache's SlabSet
        self._file_unit: dict[int, int] = {}  # streamed index -> transport file unit
        self._hollow_views: dict[int, list[torch.Tensor]] = {}
        self._disk_params: list[tuple[nn.Parameter, Any]] = []
        self.staging_buffer_bytes = 0
        self._layout: tuple[list[list[int]], list[int]] | None = None
        self._file_ids: dict[str, int] = {}
        self._direct_files: dict[str, bool] = {}  # as last asked: a read refused O_DIRECT turns it off
        self.disk_call_bytes: list[int] = []
        self._disk_bytes0 = 0
        self._final_disk_stats = (0, 0)
        self.lost: list[str] = []
        """Parameters that remove() could not read back (their file changed): left as NaN placeholders."""
        if not self.streamed:
            return
        self.disk_bytes_per_s, self.disk_probe = bandwidth.disk_bytes_per_s(
            self._largest_file(), threads=preset.staging_threads
        )
        compute = bandwidth.compute_bytes_per_s(device, self.link_bytes_per_s)
        self.cache_plan = _native.plan_ram_cache(
            self.unit_bytes,
            unit_compute_s=[b / compute for b in self.unit_bytes],
            resident=list(self.plan["resident"]),
            slots=max(1, int(self.plan["slots"])),
            ram_budget_bytes=ram_budget,
            link_bytes_per_s=self.link_bytes_per_s,
            disk_bytes_per_s=self.disk_bytes_per_s,
        )
        cached = self.cache_plan["cached"]
        for u, unit in enumerate(self.streamed):
            if cached[unit.index]:
                self._cache_index[u] = len(self.cached_units)
                self.cached_units.append(unit)
            else:
                self.disk_units.append(u)
        self._check_sources()

    # ---------------------------------------------------------------------------------------------
    def _largest_file(self) -> Path:
        per_file: dict[Path, int] = defaultdict(int)
        for unit in self.streamed:
            for _, p in unit.params:
                src = self.loader.source(p)
                if src is not None:
                    per_file[src.path] += src.nbytes
        return max(per_file, key=lambda f: per_file[f])

    def _check_sources(self) -> None:
        """Disk units are copied from the files as stored: each tensor must match its source."""
        for u in self.disk_units:
            for name, p in self.streamed[u].params:
                src = self.loader.source(p)
                if src is None:
                    raise ConfigError(f"route='nvme': parameter {name!r} has no tensor in the checkpoint to read")
                if src.dtype != p.dtype or src.nbytes != tensor_nbytes(p):
                    raise ConfigError(
                        f"route='nvme' streams tensors from the files as stored, but {name!r} is {src.dtype} in "
                        f"{src.path.name} and {p.dtype} in the model; pass dtype=None to from_pretrained (keep "
                        "the file's dtype), convert the checkpoint, or use route='linear'"
                    )

    # ---------------------------------------------------------------------------------------------
    # attach: slabs for the cache, meta placeholders for disk units, file units in the transport
    # ---------------------------------------------------------------------------------------------
    def _build_slabs(self) -> None:
        if not self.streamed:
            return
        if self.cached_units:
            pin = self.device.type == "cuda"
            self.slabs = SlabSet(self.cached_units, pin=pin, ordinal=self.device.index or 0, keep_warm=False)
            self.slabs.pack(self.loader)
        for u in self.disk_units:
            views = []
            for _, p in self.streamed[u].params:
                src = self.loader.take(p)
                hollow = _placeholder(p)
                self._disk_params.append((p, src))
                p.data = hollow  # frees the unread buffer from unmeta()
                views.append(hollow)
            self._hollow_views[u] = views

    def _streamed_layout(self) -> tuple[list[list[int]], list[int]]:
        if self._layout is None:
            layouts = [_native.layout_unit([span_nbytes(g) for g in unit]) for unit in self.geometry]
            self._layout = ([list(o) for o, _ in layouts], [int(n) for _, n in layouts])
        return self._layout

    def _make_transport(self) -> Any:
        pre = self.preset
        # a ring buffer holds at most one unit's aligned reads: small models do not get 4 x 64 MiB
        unit_read = -(-(self.slot_bytes + 2 * _native_align()) // (1 << 20)) << 20
        self.staging_buffer_bytes = min(pre.staging_buffer_mib << 20, unit_read)
        staging = (pre.staging_buffers, self.staging_buffer_bytes, pre.staging_threads, True)
        copy_stream = self._copy_stream.cuda_stream if self._copy_stream is not None else 0
        transport = _native.Transport(self.device.type, self.device.index or 0, self.n_slots, copy_stream, staging,
                                      stage_host=False)
        try:
            offsets = self._streamed_layout()[0]
            file_ids: dict[Path, int] = {}
            for u in self.disk_units:
                pieces = []
                for (_, p), off in zip(self.streamed[u].params, offsets[u]):
                    src = self.loader.source(p)
                    if src.path not in file_ids:
                        file_ids[src.path] = transport.open_file(str(src.path))
                    pieces.append((file_ids[src.path], src.offset, src.nbytes, off))
                self._file_unit[u] = transport.add_file_unit(pieces, READ_GAP_BYTES)
            self._file_ids = {p.name: i for p, i in file_ids.items()}
        except BaseException:
            transport.close()
            raise
        return transport

    # ---------------------------------------------------------------------------------------------
    # the pipeline: only the source of a fetch and the parking place of a unit differ
    # ---------------------------------------------------------------------------------------------
    def _fetch(self, u: int, slot: int) -> None:
        assert self.slot_storage is not None
        dst = self.slot_storage.data_ptr() + slot * self.slot_bytes
        ci = self._cache_index.get(u)
        if ci is None:
            self.transport.fetch_file(slot, dst, self._file_unit[u])
        else:
            self.transport.fetch(slot, dst, self.slabs.unit_ptr(ci), self.slabs.unit_nbytes[ci])

    def _park(self, u: int) -> None:
        ci = self._cache_index.get(u)
        self._bind(self.streamed[u], self.slabs.host_views[ci] if ci is not None else self._hollow_views[u])

    def _enter(self) -> None:
        first = self._depth == 0
        super()._enter()
        if first and self._disk_params:
            self._disk_bytes0 = self.transport.disk_stats()[1] if self.transport is not None else 0
            try:
                self._check_files()
            except BaseException:
                self._exit(clean=False)  # the caller's finally does not run when _enter raises
                raise

    def _exit(self, clean: bool = True) -> None:
        super()._exit(clean)
        if self._depth == 0 and self._disk_params and self.transport is not None:
            self.disk_call_bytes.append(self.transport.disk_stats()[1] - self._disk_bytes0)

    def _check_files(self) -> None:
        """One stat per checkpoint file: a replaced or truncated file stops the call."""
        try:
            self.loader.checkpoint.check_unchanged()
        except CheckpointError as exc:
            raise CheckpointError(
                f"{type(self.module).__name__} is offloaded with route='nvme' and reads weights from its files "
                f"on every call, but {exc}. The offload cannot go on: remove() it and load the model again"
            ) from exc

    # ---------------------------------------------------------------------------------------------
    # removal: disk units come back into ordinary memory
    # ---------------------------------------------------------------------------------------------
    def _rollback(self) -> None:
        error: CheckpointError | None = None
        disk, self._disk_params = self._disk_params, []
        if disk:
            try:
                self.loader.checkpoint.check_unchanged()
                pairs = [(src, torch.empty(p.shape, dtype=p.dtype)) for p, src in disk]
                self.loader.read_many(pairs)
                for (p, _), (_, t) in zip(disk, pairs):
                    p.data = t  # the linear rollback then moves it to its original device
            except CheckpointError as exc:
                error = exc
                names = {id(p): n for n, p in self.module.named_parameters()}
                for p, _ in disk:
                    self._orig_device.pop(id(p), None)  # stays a NaN placeholder: unusable rather than wrong
                    self.lost.append(names.get(id(p), "?"))
            except BaseException as exc:
                # nothing is detached yet: the offload stays in place and working, remove() can be retried
                self._disk_params = disk
                if isinstance(exc, MemoryError):
                    nbytes = sum(p.numel() * p.element_size() for p, _ in disk)
                    raise OffloadMemoryError(
                        f"removing the offload of {type(self.module).__name__} reads the {len(disk)} tensors kept "
                        f"on disk back into host RAM ({fmt_bytes(nbytes)}), and that allocation failed ({exc}). "
                        "The offload is still in place and the module still runs: free host memory and call "
                        "remove() again, or keep the offload"
                    ) from exc
                raise
        if self.transport is not None:
            # Closed here, not by the linear rollback: a failed disk read is reported again by
            # close() (after draining), and must not stop the rest of the removal.
            self._final_disk_stats = self.transport.disk_stats()
            self._final_transport_stats = self.transport.stats()
            close_error: DdoError | None = None
            try:
                with contextlib.suppress(CheckpointError):  # already raised by the call that met it
                    self.transport.close()
            except DdoError as exc:  # finish the removal first
                close_error = exc
            finally:
                self.transport = None
            if close_error is not None:
                self._hollow_views = {}
                super()._rollback()
                raise close_error
        self._hollow_views = {}
        super()._rollback()
        if error is not None:
            raise CheckpointError(
                f"the offload of {type(self.module).__name__} was removed, but {len(disk)} tensors read from disk "
                f"could not be restored ({error}); they were left as empty placeholders (NaN): load the model again"
            ) from error

    # ---------------------------------------------------------------------------------------------
    # prediction and report
    # ---------------------------------------------------------------------------------------------
    def _disk_sim_args(self) -> tuple:
        if self.disk_bytes_per_s is None:
            return ()
        from_disk = list(self.cache_plan["from_disk"]) if self.cache_plan else [False] * len(self.units)
        return from_disk, self.disk_bytes_per_s

    @property
    def cached_bytes(self) -> int:
        return sum(self.unit_bytes[u.index] for u in self.cached_units)

    @property
    def disk_bytes(self) -> int:
        """Unit bytes read from disk per call (before alignment)."""
        return sum(self.unit_bytes[self.streamed[u].index] for u in self.disk_units)

    @property
    def disk_bound_s(self) -> float | None:
        return self.disk_bytes / self.disk_bytes_per_s if self.disk_bytes_per_s else None

    def report_extra(self) -> dict[str, dict[str, Any]]:
        """Fields the report adds for this route."""
        stats = self.transport.disk_stats() if self.transport is not None else self._final_disk_stats
        if self.transport is not None:
            self._direct_files = {n: bool(self.transport.file_is_direct(i)) for n, i in self._file_ids.items()}
        last = self.disk_call_bytes[-1] if self.disk_call_bytes else None
        return {
            "plan": {
                "ram_budget_bytes": self.ram_budget,
                "cached_units": len(self.cached_units),
                "cached_bytes": self.cached_bytes,
                "disk_units": len(self.disk_units),
                "disk_bytes": self.disk_bytes,
                "staging_bytes": self.preset.staging_buffers * self.staging_buffer_bytes,
                "predicted_step_s": self.cache_plan["predicted_step_s"] if self.cache_plan else self.plan[
                    "predicted_step_s"],
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
