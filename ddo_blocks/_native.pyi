"""Type stubs of the private extension ``ddo_blocks._native`` (rust/ddo-py). Python passes addresses,
byte counts and CUDA stream handles and keeps the memory behind them alive; errors are the classes
below. The public API is the Python package; this module is not part of it."""

from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any

__version__: str

class DdoError(Exception): ...
class ConfigError(DdoError): ...
class PlanError(DdoError): ...
class BudgetError(PlanError): ...
class CudaError(DdoError): ...
class CudaNotAvailableError(CudaError): ...
class OffloadMemoryError(CudaError): ...
class CheckpointError(DdoError): ...
class OffloadStateError(DdoError): ...

# CUDA driver
def cuda_unavailable_reason() -> str | None: ...
def cuda_device_count() -> int: ...
def cuda_driver_version() -> int: ...
def take_deferred_error() -> str | None:
    """The message of an error that could not be raised where it happened (unregistering host memory,
    restoring a CUDA context, freeing a transport that was never closed), or None; taking it clears it.
    Left untaken, the next call that binds a CUDA context raises it as a CudaError."""

# kernels compiled at run time (NVRTC, loaded like the driver)
def nvrtc_unavailable_reason() -> str | None: ...
def nvrtc_version() -> tuple[int, int]: ...

class CudaKernel:
    """CUDA C ``source`` compiled with NVRTC for ``device``'s compute capability (plus ``options``),
    loaded in its primary context; ``name`` is an ``extern "C" __global__`` function of it.
    CudaNotAvailableError without a driver or NVRTC; CudaError with NVRTC's log if it does not compile."""

    def __init__(self, source: str, name: str, device: int = 0, options: Sequence[str] = ()) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def device(self) -> int: ...
    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[tuple[str, int | float]],
        stream: int,
        shared_mem_bytes: int = 0,
    ) -> None:
        """Queues the kernel on ``stream`` (a ``torch.cuda.Stream.cuda_stream`` on its device) and returns.
        ``args`` are ``(kind, value)`` with kind "ptr", "u64", "i64", "u32", "i32", "f32" or "f64", matching
        the kernel's parameters. Unchecked contract: every "ptr" is the data pointer of a CUDA tensor on
        the device that holds what the kernel touches and stays alive until the stream has run it."""

# host memory and files
def copy_host_many(jobs: Sequence[tuple[int, int, int]]) -> None:
    """``(dst, src, nbytes)`` host copies in parallel, GIL released; ConfigError, before any copy, for a
    null, wrapping or overlapping range."""

def read_file_into(path: str | PathLike[str], jobs: Sequence[tuple[int, int, int]]) -> None:
    """``(file_offset, nbytes, dst)`` positional reads in parallel (no memory map), GIL released;
    CheckpointError for a range past the end of the file, ConfigError for a null or wrapping ``dst``."""

def measure_disk_read(path: str | PathLike[str], max_bytes: int = ..., threads: int = 8) -> tuple[float, int, bool]:
    """``(bytes_per_s, bytes_read, o_direct)`` of a read of the file's start."""

def read_shard_index(path: str | PathLike[str]) -> dict[str, str]: ...

class HostRegistration:
    """Page-locks ``nbytes`` at ``ptr`` (owned by ``owner``, kept alive) until ``close()``."""

    def __init__(self, owner: Any, ptr: int, nbytes: int, device: int) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def registered(self) -> bool: ...
    def close(self) -> None: ...

class VmmArena:
    """Reserved device address ranges and a capped pool of physical chunks (CUDA VMM) on one device."""

    def __init__(self, ordinal: int, chunk_bytes: int, max_bytes: int) -> None: ...
    @property
    def chunk_bytes(self) -> int: ...
    def stats(self) -> tuple[int, int, int, int, int, int]: ...
    def set_max_bytes(self, max_bytes: int) -> None: ...
    def reserve(self, nbytes: int) -> int: ...
    def mapped(self, base: int) -> list[bool]: ...
    def map(self, base: int, first: int, count: int) -> int: ...
    def unmap(self, base: int, first: int, count: int) -> int: ...
    def trim(self, keep: int) -> None: ...
    def free_range(self, base: int) -> None: ...
    def close(self) -> None: ...

class SafetensorsIndex:
    """A validated safetensors file: its header (read, never memory-mapped) and the file kept open."""

    def __init__(self, path: str | PathLike[str]) -> None: ...
    def tensors(self) -> list[tuple[str, str, list[int], int, int]]:
        """``(name, dtype, shape, file_offset, nbytes)`` sorted by offset."""
    def metadata(self) -> dict[str, str] | None: ...
    @property
    def path(self) -> Path: ...
    @property
    def file_len(self) -> int: ...
    def check_unchanged(self) -> None:
        """CheckpointError if the path now names another file (renamed over it) or the file was
        modified (size, modification time, or status-change time: a rewrite with the mtime restored)."""
    def read_into(self, name: str, dst: int) -> int:
        """Positional read of tensor ``name`` from the validated file into ``dst``; its byte count."""

class Transport:
    """K slots on ``device`` ("cpu" or "cuda") and the ordered copies that fill them."""

    def __init__(
        self,
        device: str,
        ordinal: int,
        slots: int,
        copy_stream: int = 0,
        staging: tuple[int, int, int, bool] | None = None,
        stage_host: bool = True,
        piece_bytes: int = 0,
    ) -> None: ...
    def fetch(self, slot: int, dst: int, src: int, nbytes: int) -> None: ...
    def acquire(self, slot: int, compute_stream: int) -> None: ...
    def release(self, slot: int, compute_stream: int) -> None: ...
    def fence_slots(self, stream: int) -> None: ...
    def drain(self) -> None: ...
    def stats(self) -> tuple[int, int, float]:
        """``(fetches, bytes, host_wait_s)``."""
    def close(self) -> None:
        """Drains, then frees the events and the staging ring (idempotent); raises the drain's error or
        a CudaError that freeing them met (which could not be raised where it happened)."""
    # the nvme route: units read from files through the staging ring
    def open_file(self, path: str | PathLike[str], allow_direct: bool = True) -> int: ...
    def file_is_direct(self, index: int) -> bool | None: ...
    def add_file_unit(self, pieces: Sequence[tuple[int, int, int, int]], max_gap: int = 0) -> int:
        """``[(file, file_offset, nbytes, slot_offset)]``, one per tensor; returns the unit index."""
    def fetch_file(self, slot: int, dst: int, unit: int) -> None: ...
    def disk_stats(self) -> tuple[int, int]: ...
    # the codec: units held coded, decoded into the slot (a decode ring of landing buffers on a GPU)
    def set_decoder(self, decode_stream: int, landing: Sequence[int], landing_bytes: int) -> None: ...
    def add_coded_unit(self, unit: CodedUnit, host: int) -> int: ...
    def coded_link_bytes(self, unit: int) -> int:
        """Bytes one fetch of the coded unit sends (on the GPU its batches of chunks, ddo_core::landing)."""
    def fetch_coded(self, slot: int, dst: int, unit: int) -> None: ...
    def add_staged_unit(self, unit: CodedUnit) -> int:
        """A coded unit read from a file (the NVMe route's side file): its layout, for fetch_file_coded."""
    def fetch_file_coded(self, slot: int, dst: int, file_unit: int, coded: int, staged: int) -> None:
        """file_unit's bytes (the coded unit's) read into staged, then decoded into the slot on the copy stream."""
    def fetch_host_coded(self, slot: int, dst: int, coded: int, host: int, staged: int) -> None:
        """The coded unit's bytes at host copied into staged, then decoded into the slot on the copy stream."""

# the lossless 12-bit code for bf16 (ddo_core::codec)
CODEC_CHUNK_ELEMS: int
CODEC_BLOCK: int
CODEC_SUB_ELEMS: int
HUFFMAN_RANGE_ELEMS: int

class CodedUnit:
    """A unit laid out in coded form: raw pieces and coded chunks, in slot order."""

    @property
    def nbytes(self) -> int:
        """Bytes of the host buffer: what one fetch sends over the link."""
    @property
    def out_bytes(self) -> int: ...
    @property
    def largest_coded(self) -> int: ...
    @property
    def coded_values(self) -> int: ...
    @property
    def escapes(self) -> int: ...
    @property
    def coded_pieces(self) -> list[tuple[int, int, int, int, int, int | list[tuple[int, int]] | None]]:
        """``(src, len, dst, values, escapes, extra)`` per coded chunk (``extra``: tier-2 groups of the
        two-tier code, ``(symbols, segments)`` per range of the Huffman code, ``None`` for the fixed-rate
        code)."""
    @property
    def code(self) -> str:
        """``"fixed"``, ``"tiered"`` or ``"huffman"``."""
    @property
    def raw_pieces(self) -> list[tuple[int, int, int]]:
        """``(src, len, dst)`` per raw piece."""

def codec_count_escapes(tensors: Sequence[tuple[int, int]]) -> list[list[list[int]]]:
    """Escapes of each ``(address, values)`` bf16 tensor, per chunk, per range of ``CODEC_SUB_ELEMS`` values."""
def codec_count_tiered(tensors: Sequence[tuple[int, int]]) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """The two-tier code's ``(escapes, tier-2 groups)`` of each bf16 tensor, in codec_count_escapes' shape."""
def codec_count_huffman(tensors: Sequence[tuple[int, int]]) -> list[list[list[tuple[int, int]]]]:
    """The Huffman code's ``(symbols, segments)`` of each bf16 tensor, per chunk, per range of
    ``HUFFMAN_RANGE_ELEMS`` values."""
def layout_coded_unit_huffman(tensors: Sequence[tuple[int, int, bool]],
                              ranges: Sequence[Sequence[Sequence[tuple[int, int]]]], max_chunk_bytes: int) -> CodedUnit:
    """As layout_coded_unit, in the Huffman code; ``ranges``: per bf16 tensor, from codec_count_huffman."""
def layout_coded_unit(tensors: Sequence[tuple[int, int, bool]], escapes: Sequence[Sequence[Sequence[int]]],
                      max_chunk_bytes: int, groups: Sequence[Sequence[Sequence[int]]] | None = None) -> CodedUnit:
    """``tensors``: ``(slot_offset, nbytes, is_bf16)``; ``escapes``: per bf16 tensor, from codec_count_escapes
    (or codec_count_tiered, whose ``groups`` select the two-tier code)."""
def codec_encode_unit(unit: CodedUnit, tensors: Sequence[tuple[int, int]], dst: int) -> None: ...
def codec_compose(parts: Sequence[tuple[CodedUnit, int, int]]) -> CodedUnit:
    """One unit from units of one tensor each: (unit, offset in the new buffer, offset in the slot)."""
def codec_capacity(tensors: Sequence[tuple[int, int, bool]]) -> int:
    """Bytes a unit of these (slot_offset, nbytes, is_bf16) tensors can take coded, whatever its counts."""
def codec_encode_unit_fused(tensors: Sequence[tuple[int, int, bool]], sources: Sequence[tuple[int, int]], code: str,
                            max_chunk_bytes: int, dst: int, capacity: int) -> CodedUnit:
    """Counts, lays out and codes a unit in ``code`` ("fixed", "tiered", "huffman") in one pass over its
    weights into capacity bytes at dst."""
def codec_decode_unit(unit: CodedUnit, src: int, tensors: Sequence[tuple[int, int]]) -> None: ...
def codec_decode_device(device: int, stream: int, chunk: int, out: int, values: int, escapes: int,
                        extra: int | list[tuple[int, int]] | None = None) -> None:
    """Queues the GPU decode of one coded chunk (device addresses) on ``stream``."""
def codec_decode_host(src: int, length: int, out: int, values: int, escapes: int,
                      extra: int | list[tuple[int, int]] | None = None) -> None:
    """Decodes one coded chunk (host addresses) with the reference decoder."""

# planning: every result is a frozen class (read-only attributes, __repr__, __eq__; to_dict() for reports)
class Plan:
    """The planner's answer: which units stay resident, how many slots stream the rest."""

    @property
    def resident(self) -> list[bool]:
        """Per unit: kept resident (True) or streamed."""
    @property
    def slots(self) -> int:
        """0 when nothing streams."""
    @property
    def slot_bytes(self) -> int:
        """The largest streamed unit."""
    @property
    def prefetch_depth(self) -> int: ...
    @property
    def resident_bytes(self) -> int:
        """Always-resident bytes plus the resident units."""
    @property
    def streamed_bytes(self) -> int:
        """Bytes copied per pass."""
    @property
    def gpu_bytes(self) -> int:
        """``resident_bytes + slots * slot_bytes``, never above the budget."""
    @property
    def predicted_step_s(self) -> float:
        """Simulated steady-state seconds per pass."""
    @property
    def bound_s(self) -> float:
        """Roofline: max(total compute, streamed bytes / link)."""
    def to_dict(self) -> dict[str, Any]: ...

class RamCachePlan:
    """The NVMe route's RAM cache: which streamed units stay in host RAM, the rest re-read from disk every pass."""

    @property
    def cached(self) -> list[bool]: ...
    @property
    def from_disk(self) -> list[bool]: ...
    @property
    def cached_bytes(self) -> int: ...
    @property
    def disk_bytes(self) -> int: ...
    @property
    def streamed_bytes(self) -> int: ...
    @property
    def predicted_step_s(self) -> float: ...
    @property
    def compute_s(self) -> float: ...
    @property
    def disk_bound_s(self) -> float: ...
    @property
    def link_bound_s(self) -> float: ...
    @property
    def bound_s(self) -> float: ...
    def to_dict(self) -> dict[str, Any]: ...

class MinimumBudget:
    """The smallest budget that admits a plan (``bytes``) and that plan's footprint."""

    @property
    def bytes(self) -> int: ...
    @property
    def resident_bytes(self) -> int: ...
    @property
    def largest_unit(self) -> int:
        """The slot size; 0 if everything stays resident."""
    @property
    def slots(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...

class SimResult:
    """Timings of the last simulated pass."""

    @property
    def step_s(self) -> float: ...
    @property
    def first_pass_s(self) -> float: ...
    @property
    def compute_wait_s(self) -> float: ...
    @property
    def link_busy_s(self) -> float: ...
    def to_dict(self) -> dict[str, Any]: ...

class UnitLayout:
    """One unit's tensors at 256-byte aligned offsets."""

    @property
    def offsets(self) -> list[int]: ...
    @property
    def nbytes(self) -> int:
        """The unit's size."""
    def to_dict(self) -> dict[str, Any]: ...

class UnitPlacement:
    """Where a unit lies in the slabs."""

    @property
    def slab(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def to_dict(self) -> dict[str, Any]: ...

class SlabLayout:
    """Units packed into slabs."""

    @property
    def slabs(self) -> list[int]:
        """Each slab's size."""
    @property
    def placements(self) -> list[UnitPlacement]:
        """Per unit, in order."""

def scan_module_dicts(
    dicts: list[dict[str, Any]],
) -> tuple[int, int, list[tuple[int, Any | None, Any | None]], int]:
    """One pass over modules' ``__dict__``s: ``(forward hook count, newest hook id or -1, found, tree)``,
    ``found`` being ``(index, _diffusers_hook or None, _hf_hook or None)`` for each module with either,
    ``tree`` a hash of each instance's own ``forward`` and of what each module's ``_parameters``,
    ``_buffers`` and ``_modules`` hold, by name and value identity."""
class DeviceGraph:
    """A ``torch.cuda.CUDAGraph(keep_graph=True)``'s graph instantiated again for device launch."""

    def __init__(self, raw_graph: int, device: int, stream: int) -> None:
        """Instantiates ``raw_graph`` (``raw_cuda_graph()``) for device launch and uploads it on ``stream``;
        ``CudaError`` with the driver's reason where device launch does not allow the graph."""
    def launch(self, stream: int) -> None:
        """Launches the graph on ``stream`` (a ``cuda_stream`` handle of its device)."""

def graph_census(raw_graph: int, device: int) -> dict[str, int]:
    """``{kind: count}`` of a captured graph's nodes (``memcpy_htod`` apart from other copies) and its
    ``"edges"``; ``CudaError`` where the driver cannot list it."""

class TreeWatch:
    """Every dict a scan of modules reads, with CPython's version tag of each (``guards.HookScan``)."""

    @staticmethod
    def snapshot(dicts: list[dict[str, Any]]) -> TreeWatch | None:
        """The watch of modules' ``__dict__``s and of the ``_parameters``, ``_buffers``, ``_modules``
        and hook dicts they hold; ``None`` where the tags do not work or one of those is not a dict."""
    def unchanged(self) -> bool:
        """Whether no watched dict was written since the snapshot."""
    def __len__(self) -> int: ...

def plan(
    unit_bytes: Sequence[int],
    *,
    base_bytes: int,
    budget_bytes: int | None,
    link_bytes_per_s: float,
    compute_bytes_per_s: float,
    min_slots: int = 2,
    max_slots: int = 4,
    unit_compute_s: Sequence[float] | None = None,
    link_bytes: Sequence[int] | None = None,
) -> Plan:
    """``link_bytes``: per unit, the bytes it sends over the link when streamed (a codec's), if not its size."""
def plan_ram_cache(
    unit_bytes: Sequence[int],
    *,
    unit_compute_s: Sequence[float],
    resident: Sequence[bool],
    slots: int,
    ram_budget_bytes: int,
    link_bytes_per_s: float,
    disk_bytes_per_s: float,
) -> RamCachePlan: ...
def minimum_budget(unit_bytes: Sequence[int], base_bytes: int, min_slots: int = 2) -> MinimumBudget: ...
def simulate(
    unit_bytes: Sequence[int],
    unit_compute_s: Sequence[float],
    resident: Sequence[bool],
    slots: int,
    link_bytes_per_s: float,
    passes: int = 3,
    from_disk: Sequence[bool] | None = None,
    disk_bytes_per_s: float | None = None,
) -> SimResult: ...
def layout_unit(tensor_bytes: Sequence[int]) -> UnitLayout: ...
def layout_slabs(unit_bytes: Sequence[int], max_slab_bytes: int) -> SlabLayout: ...
