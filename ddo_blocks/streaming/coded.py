"""The coded host side (``codec="fixed"`` or ``"tiered"`` on the linear route): streamed units held
in host RAM in a lossless coded form of their bf16 weights (12 bits per value, or about 11 with the
two-tier code), sent over the link as such and decoded into the slot.

- At attach, unit by unit: the counts of every chunk (escapes; tier-2 groups for the two-tier code;
  ``ddo-core``'s ``codec`` and ``tiered``, in parallel),
  the unit's coded layout (bf16 tensors of at least :data:`MIN_CODED_VALUES` values are coded in
  chunks of up to 8 Mi values; every other tensor, and a chunk that would not shrink, is sent as it
  is), the coded buffer (a slice of one host reservation made at attach, its pages taken only as the
  code reaches them; page-locked on a GPU, in the background while the next unit is coded), and
  the parameters pointed at placeholders (one NaN element): the original bytes are freed as the
  coded ones are written, so host RAM stays at about the coded size plus one unit.
- A fetch is one copy job: raw pieces straight into the slot, coded chunks through a ring of
  :func:`landing_count` landing buffers in device memory (allocated through PyTorch, inside the
  VRAM budget) and decoded by a kernel on a decode stream (``ddo_cuda::codec``, ``ddo_cuda::tiered``).
  The chunks' copies are queued before the wait for the slot's last consumer (only the decodes
  wait for it), so the link moves the next unit while the slot's unit still computes;
  on the CPU engine the reference decoder writes the slot. Outputs are the original bits: at the
  first attach on a device, the kernel's decode of the largest chunk is compared bit for bit with
  the reference decoder's, and a difference refuses the offload (:func:`_check_decoder`).
- ``remove()`` (and a failed attach) decodes every coded unit back into fresh memory of the
  parameters' own shapes and strides, giving each unit's coded pages back as it goes.

The report gets a ``codec`` section: coded and raw bytes, the ratio, the bytes one call sends, the
escapes, the landing buffers, and on a GPU the decode rate measured at attach.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import _native
from ..errors import ConfigError, DdoError
from ..routes.spec import HostMode, Preset
from ..units import flat_span, span_elements, span_nbytes, split_units
from .plan import unit_sizes as plan_unit_sizes
from .slabs import PAGE, _alloc, _progress
from .stores import InMemoryStore, _placeholder

log = logging.getLogger("ddo_blocks")

CODECS = ("off", "fixed", "tiered", "huffman", "lossless")
"""``off``: units cross the link as they are. ``fixed``: bf16 weights at 12 bits per value (0.751 of
bf16 on normal weights). ``tiered``: the two-tier code, about 11 bits per value (0.689).
``huffman``: the exponent Huffman-coded, about 10.65 bits per value (0.666). ``lossless``: the
planner chooses (:func:`choose_lossless`): one of the codes or none, and which fraction of the units
to code, by the step it predicts for each, then again once with the compute the second call
measured."""

CODES = ("fixed", "tiered", "huffman")
"""The codecs that code: what ``lossless`` chooses from (besides not coding)."""

QUARTERS = 4
"""Coded fractions tried: 0, 1/4, ... 1 of the units that shrink coded, spread in execution order."""

LOSSLESS_MARGIN = 0.02
"""A variant that codes every unit must be predicted this much faster than one coding none to be
chosen (a quarter of the units, a quarter of it): the decode's cost on the SMs is an estimate, and
not coding is never slower than the uncompressed route."""

TIERED_ESTIMATE = (0.28, 0.003)
"""The two-tier code's tier-2 and escape fractions on normal weights (measured by ddo-core's
``tiered_speed`` measurement: 0.27-0.28 and 0.003): the link-bytes estimate before the weights are read."""

HUFFMAN_ESTIMATE = (2.62, 17)
"""The Huffman code's bits per exponent (its segments' fill included) and symbols per range on normal
weights (``ddo_core::huffman``'s ratio test: 0.666 of bf16 in all): the link-bytes estimate before the
weights are read."""

HUFFMAN_ALLOWANCE = 4.0
"""A landing buffer holds a Huffman chunk whose exponents take this many bits each (plus every range's
256 symbols); a chunk that needs more is sent raw."""

TIERED_ALLOWANCE = 2
"""A landing buffer holds a two-tier chunk with one value in this many in tier 2 (plus the escape
allowance); a chunk that needs more is sent raw."""

MIN_CODED_VALUES = 4096
"""bf16 tensors smaller than this are sent as they are (their bytes are negligible)."""

LANDING_BUFFERS = (3, 64)
"""The fewest and most coded chunks in flight on the device (:func:`landing_count`): copied ahead
of their decode, as a chunk's copy waits for no slot, only for a landing buffer to be decoded out of."""

LANDING_AHEAD = 3.0
"""The landing ring holds this many times the coded chunks of the largest child unit (each buffer
one chunk of up to 8 Mi values), so that the link moves the next streamed units while the resident
ones between them compute and the slots they go to are still in use. For Flux-sized blocks (the
largest child unit, a double block's attention, fills 11 buffers) that is 34 buffers, 0.43 GiB. Swept on the H200 (Flux-dev-sized, 1024x1024,
``benchmarks.codec_sweep``, 2026-12-02 run-1): with 8 / 16 / 32 buffers the ``fixed`` step at 8 GiB
was 1.21 / 1.14 / 1.03x of its compressed bound, at the minimum budget 1.08 / 1.07 / 1.07x (the
ring is taken from the budget: at 8 GiB the 32 buffers still gave the fastest step)."""

ESCAPE_ALLOWANCE = 32
"""A landing buffer holds a full chunk with one value in this many escaped; a chunk with more
escapes than fit is sent raw."""

_DECODE_RATE: dict[tuple[str, str], float | None] = {}
"""The decode rate the planner weighs a coded unit's decode with (bytes of bf16 written per second)
per CUDA device and codec, once per process (:func:`decode_rate`): the slower of the kernel's rate
alone and beside a GEMM load (:data:`DECODE_RATES`)."""

DECODE_RATES: dict[tuple[str, str], dict[str, float | None]] = {}
"""``(str(device), codec)`` -> ``{"alone": ..., "under_load": ..., "planning": ...}``, bytes of bf16
written per second: the decode kernel timed on the idle device, its added cost beside a GEMM load
(``None`` where that could not be measured) and the slower of the two, which :func:`decode_rate`
returns (:func:`_decode_rates`)."""


def check_codec(codec: str, preset: Preset) -> str:
    if not isinstance(codec, str) or codec not in CODECS:
        raise ConfigError(f"codec={codec!r} is not a codec; use one of {', '.join(map(repr, CODECS))}")
    if codec != "off" and (preset.host is not HostMode.PINNED_SLABS or preset.keep_warm):
        raise ConfigError(
            f"codec={codec!r} holds the streamed units coded in page-locked memory and sends them straight to "
            f"the GPU; preset {preset.name!r} ({preset.summary.split(',')[0]}) does not: use preset='one_shot_fast' "
            "(or codec='off')"
        )
    return codec


def _bf16_values(p: torch.Tensor) -> int:
    return span_elements(p) if p.dtype == torch.bfloat16 else 0


@functools.lru_cache(maxsize=4096)
def _probe_bytes(values: int, codec: str, escape_fraction: float, tier2_fraction: float,
                 huffman: tuple[float, int] = HUFFMAN_ESTIMATE) -> int:
    """The coded size of one tensor of ``values`` values with these fractions of its values escaped
    and (``tiered``) in tier 2, spread evenly over its chunks and ranges; ``huffman``: its bits per
    exponent and symbols per range."""
    chunk, sub = _native.CODEC_CHUNK_ELEMS, _native.CODEC_SUB_ELEMS
    if codec == "huffman":
        bits, symbols = huffman
        rng = _native.HUFFMAN_RANGE_ELEMS
        ranges = [[(symbols, max(1, math.ceil(min(rng, n - r) * bits / 128))) for r in range(0, n, rng)]
                  for n in (min(chunk, values - start) for start in range(0, values, chunk))]
        return _native.layout_coded_unit_huffman([(0, 2 * values, True)], [ranges], 1 << 62).nbytes

    def counts(per_value: float, per: int) -> list[list[int]]:
        out = []
        for start in range(0, values, chunk):
            n = min(chunk, values - start)
            out.append([int(min(sub, n - s) * per_value) // per for s in range(0, n, sub)])
        return out

    groups = [counts(tier2_fraction, 8)] if codec == "tiered" else None
    probe = _native.layout_coded_unit([(0, 2 * values, True)], [counts(escape_fraction, 1)], 1 << 62, groups)
    return probe.nbytes


def landing_bytes(module: nn.Module, codec: str = "fixed") -> int:
    """Bytes of one landing buffer: a full chunk of the largest coded tensor, with the allowance of
    escapes (and of tier-2 codes)."""
    largest = max((_bf16_values(p) for p in module.parameters()), default=0)
    if largest < MIN_CODED_VALUES:
        return 0
    values = min(largest, _native.CODEC_CHUNK_ELEMS)
    nbytes = _probe_bytes(values, codec, 1 / ESCAPE_ALLOWANCE, 1 / TIERED_ALLOWANCE, (HUFFMAN_ALLOWANCE, 256))
    return -(-nbytes // 256) * 256


def landing_count(module: nn.Module, codec: str = "fixed") -> int:
    """Landing buffers of the decode ring: for the child unit that needs the most, :data:`LANDING_AHEAD`
    of its coded chunks (a buffer holds one), or of its bytes in buffers if fewer (small tensors, each
    a chunk), within :data:`LANDING_BUFFERS`. Read from the module before it is offloaded: the reserve
    at planning time and the ring at attach must agree."""
    fewest, most = LANDING_BUFFERS
    lb = landing_bytes(module, codec)
    if lb == 0:
        return fewest
    chunk = _native.CODEC_CHUNK_ELEMS
    need = 0
    for u in split_units(module, "child")[0]:
        values = [v for v in (_bf16_values(p) for _, p in u.params) if v >= MIN_CODED_VALUES]
        chunks = sum(-(-v // chunk) for v in values)
        need = max(need, min(math.ceil(LANDING_AHEAD * chunks), math.ceil(LANDING_AHEAD * 2 * sum(values) / lb)))
    return max(fewest, min(most, need))


def coded_estimate(units: list[Any], codec: str) -> list[int]:
    """Per unit, the bytes a coded fetch sends, before the weights are read: coded bf16 tensors at
    their chunk layout (fixed: without escapes, about 0.751x; tiered: :data:`TIERED_ESTIMATE`,
    about 0.69x; huffman: :data:`HUFFMAN_ESTIMATE`, about 0.666x), the rest as they are. ``units``:
    units, or per unit its tensors (or their ``units.geometry``: a coded unit's parameters are
    placeholders)."""
    tier2, esc = TIERED_ESTIMATE if codec == "tiered" else (0.0, 0.0)
    out = []
    for unit in units:
        total = 0
        for p in ([p for _, p in unit.params] if hasattr(unit, "params") else unit):
            values = _bf16_values(p)
            total += _probe_bytes(values, codec, esc, tier2) if values >= MIN_CODED_VALUES else span_nbytes(p)
        out.append(total)
    return out


def spread(eligible: list[bool], quarters: int) -> list[bool]:
    """Which units to code: ``quarters`` / :data:`QUARTERS` of the ``eligible`` ones (those that shrink
    coded), spread evenly in execution order (the j-th eligible unit is coded when the count steps)."""
    mask = [False] * len(eligible)
    j = 0
    for i, ok in enumerate(eligible):
        if ok:
            mask[i] = (j + 1) * quarters // QUARTERS > j * quarters // QUARTERS
            j += 1
    return mask


def coded_units(units: list[Any], codec: str, quarters: int = QUARTERS) -> list[bool]:
    """Per unit, whether a store of ``codec`` codes it when it streams, at ``quarters`` of the units
    that shrink (estimated from the module, as the planner sees them)."""
    return spread([c < r for c, r in zip(coded_estimate(units, codec), plan_unit_sizes(units))], quarters)


def link_bytes_estimate(codec: str, quarters: int = QUARTERS):
    """The planner's ``link_bytes``: per unit, :func:`coded_estimate` for the units coded at
    ``quarters`` (:func:`coded_units`), the unit's size for the others."""

    def estimate(units: list[Any]) -> list[int]:
        mask = coded_units(units, codec, quarters)
        sizes = plan_unit_sizes(units)
        return [c if m else s for c, m, s in zip(coded_estimate(units, codec), mask, sizes)]

    return estimate


def reserve_bytes(module: nn.Module, codec: str, device: torch.device) -> int:
    """Device bytes the codec needs beside the slots (its landing buffers; ``lossless``: the larger
    ring of the codes it may choose)."""
    if codec == "off" or device.type != "cuda":
        return 0
    if codec == "lossless":
        return max(reserve_bytes(module, c, device) for c in CODES)
    return landing_count(module, codec) * landing_bytes(module, codec)


def _count(codec: str, coded: list[tuple[int, int]]) -> tuple[list[Any], list[Any] | None]:
    """The counts a coded layout needs for these ``(address, values)`` bf16 tensors: escapes, and
    tier-2 groups for the two-tier code (``None`` for the fixed-rate one). Not for the Huffman code
    (:func:`_layout_one`)."""
    if codec == "tiered":
        return _native.codec_count_tiered(coded)
    return _native.codec_count_escapes(coded), None


def _layout_one(codec: str, t: torch.Tensor, max_chunk_bytes: int) -> Any:
    """The coded layout of one contiguous bf16 CPU tensor in ``codec``."""
    if codec == "huffman":
        ranges = _native.codec_count_huffman([(t.data_ptr(), t.numel())])
        return _native.layout_coded_unit_huffman([(0, 2 * t.numel(), True)], ranges, max_chunk_bytes)
    escapes, groups = _count(codec, [(t.data_ptr(), t.numel())])
    return _native.layout_coded_unit([(0, 2 * t.numel(), True)], escapes, max_chunk_bytes, groups)


def _per_tensor(counts: list[Any], coded: list[bool]) -> list[Any]:
    """Counts given for the coded tensors only, spread over all of them (``[]`` for the others)."""
    it = iter(counts)
    return [next(it) if b else [] for b in coded]


def planning_rate(device: torch.device, codec: str) -> float | None:
    """The decode rate the planner weighs ``codec`` with on ``device`` (:func:`decode_rate`), or
    ``None`` where the decode does not share the device's SMs with the model (the CPU engine decodes
    on the host in place of its copy): there the planner sees no cost and no gain to weigh. A code
    whose kernel failed its check on this device is left out (``None``, logged, and named by
    :data:`LEFT_OUT`): ``lossless`` then chooses among the others."""
    if device.type != "cuda" or codec not in CODES or (str(device), codec) in LEFT_OUT:
        return None
    try:
        return decode_rate(device, codec)
    except DdoError as exc:
        if (str(device), codec) not in LEFT_OUT:
            log.warning("ddo_blocks: codec %r left out on %s: %s", codec, device, exc)
        LEFT_OUT[(str(device), codec)] = str(exc)
        return None


LEFT_OUT: dict[tuple[str, str], str] = {}
"""(device, code) -> why ``lossless`` leaves that code out there (its kernel failed its check)."""


class Choice(NamedTuple):
    """What ``codec="lossless"`` chose at attach: the codec (``off`` for none), the quarters of the
    units that shrink it codes, and each candidate's predicted step (the planner's prior)."""

    codec: str
    quarters: int
    predicted_s: dict[str, float]
    left_out: dict[str, str] = {}
    """Codes left out on this device and why (their kernels failed their checks)."""


def label(codec: str, quarters: int) -> str:
    """A coding's name in the report: ``off``, or ``fixed 2/4`` (the code and the quarters it codes)."""
    return "off" if codec == "off" or not quarters else f"{codec} {quarters}/{QUARTERS}"


def choose_lossless(module: nn.Module, preset: Preset, budget: int | None, device: torch.device,
                    units: str) -> Choice:
    """``codec="lossless"`` at attach: the planner's predicted step for no code and for each code at
    each fraction of the units (:data:`QUARTERS`), with each unit's compute from the planner's prior
    plus its decode (``bf16 bytes / decode rate``, measured on a synthetic chunk beside a GEMM load:
    decode and model share the SMs, :func:`decode_rate`) and each code's landing buffers taken from
    the budget; the fastest wins, a coded variant only by :data:`LOSSLESS_MARGIN` (scaled by its
    fraction). The second call measures the compute and re-plans once (``OffloadHandle``)."""
    from ..errors import BudgetError
    from . import bandwidth, plan

    if budget is None:
        return Choice("off", 0, {}, {})
    link = bandwidth.link_bytes_per_s(device)
    compute_rate = bandwidth.compute_bytes_per_s(device, link)
    found: dict[tuple[str, int], float] = {}
    try:
        found[("off", 0)] = plan.choose(module, budget, device, link, preset, units).native.predicted_step_s
    except BudgetError:
        pass  # the landing buffers' reserve is in "min": no code always fits where a code does
    for codec in CODES:
        rate = planning_rate(device, codec)
        if not rate:
            continue
        for q in range(1, QUARTERS + 1):

            def compute_bytes(us: list[Any], codec: str = codec, q: int = q, rate: float = rate) -> list[int]:
                sizes = plan_unit_sizes(us)
                return [int(b + (b * compute_rate / rate if m else 0)) for b, m in zip(sizes, coded_units(us, codec, q))]

            try:
                chosen = plan.choose(module, budget, device, link, preset, units, reserve_bytes(module, codec, device),
                                     link_bytes_estimate(codec, q), compute_bytes)
            except BudgetError:
                continue
            found[(codec, q)] = chosen.native.predicted_step_s
    if not found:  # nothing fits: plan "off" again for its error
        plan.choose(module, budget, device, link, preset, units)
    best = min(found, key=lambda k: found[k] * (1 + LOSSLESS_MARGIN * k[1] / QUARTERS))
    return Choice(best[0], best[1], {label(*k): v for k, v in found.items()},
                  {c: why for (d, c), why in LEFT_OUT.items() if d == str(device)})


def measured_variants(engine: Any, unit_compute_s: list[float], codecs: tuple[str, ...], *,
                      with_off: bool) -> list[Any]:
    """Plans to try with measured compute (``plan.Measured``): for each code of ``codecs``, a fraction
    of 1/4, ... 1 of the units that shrink coded, spread evenly in execution order (:func:`spread`),
    each with its link bytes (coded or raw) and its compute with or without its decode (``bf16 bytes
    / decode rate``, taken off the measured compute of the units coded now: decode and the model share
    the SMs); and none coded (``with_off``: as ``codec="off"``, else the first code's store coding
    nothing). Coded sizes are the store's where it coded the unit, estimates elsewhere. Empty without
    a decode rate (the CPU engine)."""
    from .plan import Measured

    e = engine
    store = e.store
    now = getattr(store, "codec", "off")

    def rate_of(codec: str) -> float | None:
        own = getattr(store, "decode_bytes_per_s", None) if codec == now else None
        return own or planning_rate(e.device, codec)

    rates = {c: rate_of(c) for c in codecs}
    if not any(rates.values()):
        return []
    n = len(e.units)
    raw = list(e.unit_bytes)
    # each unit's tensors as they were at offload time (a streamed unit's now point at placeholders)
    shapes: list[Any] = [[p for _, p in u.params] for u in e.units]
    for k, unit in enumerate(e.streamed):
        shapes[unit.index] = e.geometry[k]
    actual: dict[int, Any] = {}  # unit -> the store's coded unit, where it codes some of it
    if now in CODES:
        for k, unit in enumerate(e.streamed):
            if k < len(store.units) and store.units[k].coded_values:
                actual[unit.index] = store.units[k]
    now_rate = rate_of(now) if actual else None
    pure = [max(0.0, c - (2 * actual[i].coded_values / now_rate if i in actual and now_rate else 0.0))
            for i, c in enumerate(unit_compute_s)]
    zero = "off" if with_off else codecs[0]
    variants = [Measured(e.granularity, pure, raw, [False] * n, zero)]
    for codec in codecs:
        rate = rates[codec]
        if not rate:
            continue
        sent = [min(c, r) for c, r in zip(coded_estimate(shapes, codec), raw)]
        decoded = [r if c < r else 0 for c, r in zip(sent, raw)]
        if codec == now:
            for i, cu in actual.items():
                sent[i], decoded[i] = cu.nbytes, 2 * cu.coded_values
        eligible = [d > 0 for d in decoded]
        for q in range(1, QUARTERS + 1):
            mask = spread(eligible, q)
            variants.append(Measured(
                e.granularity,
                [pure[i] + (decoded[i] / rate if mask[i] else 0.0) for i in range(n)],
                [sent[i] if mask[i] else raw[i] for i in range(n)],
                mask,
                codec,
            ))
    return variants


class _HostArena:
    """One reservation of host address space for every coded unit's buffer (``mmap`` of anonymous,
    private memory, not reserved against the commit limit), each unit a page-aligned slice of its
    capacity: the host takes memory only for the pages a unit's code reaches, and attach makes one
    ``mmap`` call where one a unit (two hundred for Flux) each waited on the address space's lock,
    which the page-locking of the unit before and the freeing of its weights hold (about 0.6 s of
    the Flux-sized model's setup on the H200's host). ``None`` from :meth:`reserve` where the host
    refuses the reservation (a strict commit limit): units then get buffers of their own."""

    def __init__(self, m: mmap.mmap, offsets: list[int]):
        self.map = m
        self.storage = torch.frombuffer(m, dtype=torch.uint8)
        self.offsets = offsets

    @classmethod
    def reserve(cls, capacities: list[int]) -> _HostArena | None:
        offsets, total = [], 0
        for c in capacities:
            offsets.append(total)
            total += -(-max(c, 1) // PAGE) * PAGE
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_NORESERVE", 0x4000)
        try:
            return cls(mmap.mmap(-1, max(total, PAGE), flags=flags), offsets)
        except (OSError, ValueError):
            return None

    def take(self, u: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = self.offsets[u]
        return self.storage, self.storage[at : at + capacity]

    def free(self, u: int, nbytes: int) -> None:
        """Gives unit ``u``'s pages back (its buffer is no longer read)."""
        if nbytes:
            self.map.madvise(mmap.MADV_DONTNEED, self.offsets[u], -(-nbytes // PAGE) * PAGE)


class CodedSlabs(InMemoryStore):
    """Every streamed unit coded in host memory (the linear route with ``codec="fixed"`` or
    ``"tiered"``). Build it with :meth:`for_codec`."""

    slabs = None
    """No :class:`SlabSet`: the report's host figures come from :meth:`report_sections`."""

    @property
    def parked_where(self) -> str:
        return f"coded in host memory (codec={self.codec!r})"

    @classmethod
    def for_codec(cls, codec: str, quarters: int = QUARTERS):
        """The store factory the engine takes (``store=``) for ``codec``, coding ``quarters`` of the
        units that shrink (:func:`coded_units`) unless the engine was planned with a measured mask."""
        return lambda engine: cls(engine, codec, quarters)

    def __init__(self, engine: Any, codec: str = "fixed", quarters: int = QUARTERS):
        self.engine = engine
        self.codec = codec
        measured = engine.measured.coded if engine.measured is not None else None
        self.mask: list[bool] = list(measured) if measured is not None else coded_units(engine.units, codec, quarters)
        """Per unit of the plan (streamed or not): whether it is coded when it streams."""
        self.pin = engine.device.type == "cuda"
        self.landing_bytes = landing_bytes(engine.module, codec)
        self.landing_buffers = landing_count(engine.module, codec)
        self.units: list[Any] = []  # _native.CodedUnit per streamed unit
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (storage, buffer) per unit
        self.arena: _HostArena | None = None
        """The buffers' host memory (``None``: a buffer each, or none yet)."""
        self.registrations: dict[int, Any] = {}  # streamed unit -> its buffer's page-locking
        self._hollow: list[list[torch.Tensor]] = []
        self._coded: set[int] = set()  # streamed units whose parameters are placeholders
        self._ids: list[int] = []
        self.landing: torch.Tensor | None = None
        self.link_call_bytes = 0
        """Bytes a call sends for the coded units (the transport's count, set at attach)."""
        self.decode_stream: Any = None
        self.decode_bytes_per_s: float | None = None
        self.encode_s = 0.0
        self.lost: list[str] = []

    # -- attach ------------------------------------------------------------------------------------
    def _sources(self, u: int) -> list[torch.Tensor]:
        """Unit ``u``'s tensors as contiguous CPU spans (read from the checkpoint when pending)."""
        e = self.engine
        out = []
        reads = []
        for _, p in e.streamed[u].params:
            if e.loader is not None and e.loader.pending(p):
                t = torch.empty(span_elements(p), dtype=p.dtype)
                reads.append((e.loader.take(p), t))
            elif p.device.type == "cpu" and type(p.data) is torch.Tensor:
                t = flat_span(p.data)
            else:
                t = flat_span(p.data).detach().to("cpu").contiguous()
            out.append(t)
        if reads:
            e.loader.read_many(reads)  # the unit's tensors in parallel positional reads
        return out

    def build(self) -> None:
        e = self.engine
        t0 = time.perf_counter()
        clock = self.phase_s = dict.fromkeys(("read", "alloc", "encode", "pin_wait", "rate_wait"), 0.0)

        def lap(phase: str, since: float) -> float:
            now = time.perf_counter()
            clock[phase] += now - since
            return now

        pinning: list[tuple[int, Future]] = []
        total = sum(e.layout_bytes)
        mask = self.mask  # a plan may code fewer units than shrink
        # a buffer each unit fits whatever its counts: the pages past its coded size are never touched
        capacities = [_native.codec_capacity([(off, span_nbytes(p), False) for (_, p), off in zip(unit.params, e.offsets[u])])
                      for u, unit in enumerate(e.streamed)]
        self.arena = _HostArena.reserve(capacities)
        lap("alloc", t0)
        freeing: list[Future] = []
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddo-pin") as pool, ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ddo-free") as freer, ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ddo-rate") as timer, _progress(
                total, "coding", quiet=e.loader is not None) as bar:
            # the decode rate (once per process: the kernel's compile, its check on a synthetic chunk and
            # its timing, some 0.5 s) is measured on a stream of its own while the host codes the weights,
            # unless the weights are on the GPU (their copies to the host would run beside its timing)
            on_gpu = any(p.device.type == "cuda" for unit in e.streamed for _, p in unit.params)
            rating = (timer.submit(decode_rate, e.device, self.codec)
                      if self.pin and any(mask) and not on_gpu and (str(e.device), self.codec) not in _DECODE_RATE
                      else None)
            try:
                for u, unit in enumerate(e.streamed):
                    tick = time.perf_counter()
                    srcs = self._sources(u)
                    tick = lap("read", tick)
                    code = mask[unit.index]
                    bf16 = [code and t.numel() >= MIN_CODED_VALUES and t.dtype == torch.bfloat16 for t in srcs]
                    specs = [(off, span_nbytes(t), b) for t, off, b in zip(srcs, e.offsets[u], bf16)]
                    capacity = capacities[u]
                    storage, buf = self.arena.take(u, capacity) if self.arena is not None else _alloc(capacity)
                    tick = lap("alloc", tick)
                    # count and code each tensor while it is in cache: one pass over the weights
                    layout = _native.codec_encode_unit_fused(
                        specs, [(t.data_ptr(), span_nbytes(t)) for t in srcs], self.codec,
                        self.landing_bytes if self.pin else 1 << 62, buf.data_ptr(), capacity)
                    buf = buf[: layout.nbytes]
                    tick = lap("encode", tick)
                    self.units.append(layout)
                    self.buffers.append((storage, buf))
                    hollow = [_placeholder(p) for _, p in unit.params]
                    # the original bytes go (unless the caller holds them too), freed on a thread of their
                    # own while the next unit is coded (giving back 20 GB of pages takes most of a second);
                    # at most two units behind, so host memory stays at about the coded size
                    dead = [srcs, [p.data for _, p in unit.params]]
                    for (_, p), h in zip(unit.params, hollow):
                        p.data = h
                    self._hollow.append(hollow)
                    self._coded.add(u)
                    del srcs
                    freeing.append(freer.submit(dead.clear))
                    del dead
                    if len(freeing) > 2:
                        freeing.pop(0).result()
                    if self.pin and layout.nbytes:
                        pinning.append((u, pool.submit(_native.HostRegistration, storage, buf.data_ptr(),
                                                       layout.nbytes, e.device.index or 0)))
                    bar.update(e.layout_bytes[u])
            finally:
                tick = time.perf_counter()
                errors = []
                for u, f in pinning:
                    try:
                        self.registrations[u] = f.result()
                    except DdoError as exc:
                        errors.append(exc)
                tick = lap("pin_wait", tick)
                if rating is not None and rating.exception() is not None:
                    errors.append(rating.exception())  # the measurement's error, as the transport's would be
                lap("rate_wait", tick)
                if errors:
                    raise errors[0]
        self.encode_s = time.perf_counter() - t0

    def open_transport(self, n_slots: int, slot_bytes: int, offsets: list[list[int]], copy_stream: int) -> Any:
        e = self.engine
        transport = _native.Transport(e.device.type, e.device.index or 0, n_slots, copy_stream, None)
        try:
            largest = max((c.largest_coded for c in self.units), default=0)
            if e.device.type == "cuda" and largest:
                lb = -(-largest // 256) * 256
                n = self.landing_buffers
                self.landing = torch.empty(n * lb, dtype=torch.uint8, device=e.device)
                # high priority: a decode waiting behind the model's kernels would hold its landing
                # buffer and so the copy engine; its blocks go first as SMs free up
                self.decode_stream = torch.cuda.Stream(e.device, priority=-1)
                base = self.landing.data_ptr()
                transport.set_decoder(self.decode_stream.cuda_stream, [base + k * lb for k in range(n)], lb)
                self.decode_bytes_per_s = _check_decoder(e.device, self.codec, self.units, self.buffers)
            self._ids = [transport.add_coded_unit(c, buf.data_ptr()) for c, (_, buf) in zip(self.units, self.buffers)]
            # what a call sends: on the GPU a few raw bytes between chunks go along in their batches
            self.link_call_bytes = sum(map(transport.coded_link_bytes, self._ids))
        except BaseException:
            transport.close()
            raise
        return transport

    # -- the pipeline ------------------------------------------------------------------------------
    def graph_blocker(self) -> str | None:
        return (f"codec={self.codec!r} decodes on a stream of its own whose landing-buffer events a CUDA graph "
                "capture cannot wait on yet: use codec='off' with graph=True")

    def fetch(self, transport: Any, u: int, slot: int, dst: int) -> None:
        transport.fetch_coded(slot, dst, self._ids[u])

    def host_views(self, u: int) -> list[torch.Tensor]:
        return self._hollow[u]

    def all_views(self) -> list[torch.Tensor]:
        return []

    # -- removal: every coded unit decoded back into fresh memory -----------------------------------
    def release(self, orig_device: dict[int, torch.device], keep_warm: bool) -> None:
        e = self.engine
        for u in sorted(self._coded):
            unit = e.streamed[u]
            owns = [torch.empty(span_elements(g), dtype=g.dtype) for g in e.geometry[u]]
            _native.codec_decode_unit(self.units[u], self.buffers[u][1].data_ptr(),
                                      [(t.data_ptr(), span_nbytes(t)) for t in owns])
            for (_, p), g, t in zip(unit.params, e.geometry[u], owns):
                p.data = t.as_strided(g.shape, g.stride())
            # this unit's buffer is no longer needed: unpin and free it before decoding the next, so
            # the extra host memory during remove() stays at one unit
            registration = self.registrations.pop(u, None)
            if registration is not None:
                registration.close()
            if self.arena is not None:
                self.arena.free(u, self.buffers[u][1].numel())
            self.buffers[u] = (torch.empty(0, dtype=torch.uint8),) * 2
        self._coded.clear()
        for r in self.registrations.values():  # none normally: each went with its unit above
            r.close()
        self.registrations = {}
        self.buffers = []
        self.arena = None
        self.landing = None
        self.decode_stream = None

    # -- re-planning --------------------------------------------------------------------------------
    def coded_mask(self) -> list[bool]:
        """Per unit of the plan (streamed or not): whether this store codes it when it streams."""
        return list(self.mask)

    # -- figures -----------------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        return self.landing.numel() if self.landing is not None else 0

    @property
    def host_bytes(self) -> int:
        return sum(c.nbytes for c in self.units)

    @property
    def raw_bytes(self) -> int:
        """The streamed weights' own bytes (the storage each tensor spans)."""
        return sum(span_nbytes(g) for unit in self.engine.geometry for g in unit)

    def report_sections(self, transport: Any) -> dict[str, dict[str, Any]]:
        e = self.engine
        link = e.link_bytes_per_s
        coded_values = sum(c.coded_values for c in self.units)
        decode_s = 2 * coded_values / self.decode_bytes_per_s if self.decode_bytes_per_s else None
        return {
            "plan": {"host_slabs": len(self.units), "host_slab_bytes": self.host_bytes},
            "setup": {"encode_s": self.encode_s, "packed_bytes": self.host_bytes,
                      **{f"encode_{k}_s": v for k, v in getattr(self, "phase_s", {}).items()}},
            "memory": {"pinned_bytes": sum(r.nbytes for r in self.registrations.values())},
            "codec": {
                "codec": self.codec,
                "coded_units": len(self.units),
                "raw_bytes": self.raw_bytes,
                "host_bytes": self.host_bytes,
                "ratio": self.host_bytes / self.raw_bytes if self.raw_bytes else None,
                "coded_bytes": 2 * coded_values,
                "escapes": sum(c.escapes for c in self.units),
                "link_call_bytes": self.link_call_bytes,
                "landing_buffers": self.landing_buffers if self.landing is not None else 0,
                "landing_bytes": self.device_bytes,
                "decode_gb_s": self.decode_bytes_per_s / 1e9 if self.decode_bytes_per_s else None,
                **{f"decode_{k}_gb_s": (v / 1e9 if v else None)
                   for k, v in DECODE_RATES.get((str(e.device), self.codec), {}).items() if k != "planning"},
                "decode_s_per_call": decode_s,
                "uncompressed_transfer_bound_s": e.streamed_bytes / link if link else None,
                "compressed_transfer_bound_s": self.link_call_bytes / link if link else None,
            },
        }


SYNTHETIC_VALUES = 8 << 20
"""Values of the synthetic chunk (normal(0, 0.02) bf16, seeded) whose decode :func:`decode_rate` times."""


def _synthetic_chunk(codec: str) -> tuple[torch.Tensor, Any]:
    """A coded chunk of :data:`SYNTHETIC_VALUES` normal bf16 values: ``(buffer, (src, length, values,
    escapes, groups))``, the buffer holding the unit the chunk is in."""
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(SYNTHETIC_VALUES, generator=g) * 0.02).to(torch.bfloat16)
    layout = _layout_one(codec, t, 1 << 62)
    _, buf = _alloc(layout.nbytes)
    _native.codec_encode_unit(layout, [(t.data_ptr(), 2 * t.numel())], buf.data_ptr())
    src, length, _, values, esc, grp = max(layout.coded_pieces, key=lambda piece: piece[3])
    return buf, (src, length, values, esc, grp)


def decode_rate(device: torch.device, codec: str) -> float | None:
    """Bytes of bf16 the codec's GPU kernel writes per second on the CUDA ``device`` as the planner
    weighs a coded unit's decode, once per process, device and codec. Measured on a synthetic chunk
    (:func:`_synthetic_chunk`) after its output was checked bit for bit against the reference
    decoder's (a difference is a :class:`DdoError`): the kernel alone on the idle device, and its
    added time beside a GEMM load with the decodes on a high-priority stream, as in a step
    (:func:`_time_decode`); the slower of the two (both in :data:`DECODE_RATES`), so that a device
    where the decode does cost more beside the model's kernels is planned with that. On the H200 it
    does not (2026-12-03, each batch gated: ``fixed`` 1500 GB/s alone, 1830 beside the load;
    ``tiered`` 533 and 656): there the rate alone is weighed. One measurement at a time, on a stream
    of its own; ``CodedSlabs.build`` (``fixed``, ``tiered``) runs it while the host codes the weights.
    ``None`` for ``off``."""
    if codec not in CODES:
        return None
    key = (str(device), codec)
    with _RATE_LOCK:  # one measurement at a time: two at once would each time the other's load
        if key not in _DECODE_RATE:
            rates = _check_chunk(device, codec, *_synthetic_chunk(codec), timed=True)
            DECODE_RATES[key] = rates or {"alone": None, "under_load": None, "planning": None}
            _DECODE_RATE[key] = DECODE_RATES[key]["planning"]
        return _DECODE_RATE[key]


_RATE_LOCK = threading.Lock()


def _check_decoder(device: torch.device, codec: str, units: list[Any],
                   buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
    """Checks the codec's GPU decode kernel on this device against the reference decoder on the largest
    coded chunk of these units, once per process, device and codec (a difference is a :class:`DdoError`,
    before any weight is streamed), and returns its rate (:func:`decode_rate`)."""
    key = (str(device), codec)
    if key in _CHECKED:
        return decode_rate(device, codec)
    best = None
    for c, (_, buf) in zip(units, buffers):
        for src, length, _, values, escapes, groups in c.coded_pieces:
            if best is None or values > best[1][2]:
                best = (buf, (src, length, values, escapes, groups))
    if best is None:
        return decode_rate(device, codec)
    _check_chunk(device, codec, *best, timed=False)
    _CHECKED.add(key)
    return decode_rate(device, codec)


_CHECKED: set[tuple[str, str]] = set()
"""(device, codec) whose kernel was checked against the reference decoder on real weights."""


def _check_chunk(device: torch.device, codec: str, buf: torch.Tensor, piece: tuple, *,
                 timed: bool) -> dict[str, float | None] | None:
    """Decodes one coded chunk (``piece`` of the host ``buf``) on the GPU, compares it bit for bit with the
    reference decoder's output on the host (a difference is a :class:`DdoError`) and, when ``timed``,
    returns the kernel's rates from more decodes timed alone and beside a GEMM load
    (:func:`_time_decode`)."""
    src, length, values, escapes, groups = piece
    ordinal = device.index or 0
    # a stream of its own (torch's are non-blocking): no other thread's work on the default stream, nor
    # its gate, runs inside the timings or waits for them
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        chunk = buf[src : src + length].to(device)
        out = torch.empty(values, dtype=torch.bfloat16, device=device)
        stream = torch.cuda.current_stream(device)
        run = lambda s=stream: _native.codec_decode_device(ordinal, s.cuda_stream, chunk.data_ptr(),  # noqa: E731
                                                           out.data_ptr(), values, escapes, groups)
        run()  # first launch: module load
        ref = torch.empty(values, dtype=torch.bfloat16)
        _native.codec_decode_host(buf.data_ptr() + src, length, ref.data_ptr(), values, escapes, groups)
        differ = int((out.cpu().view(torch.int16) != ref.view(torch.int16)).sum())
        if differ:
            raise DdoError(
                f"codec={codec!r}: the GPU decode kernel on {device} ({torch.cuda.get_device_name(device)}) gave "
                f"{differ} of {values} values different from the reference decoder; nothing was streamed. This is a "
                f"bug of ddo_blocks on this device: use codec='off' or another of {', '.join(c for c in CODES if c != codec)}, "
                "and report it"
            )
        if not timed:
            return None
        return _time_decode(device, stream, run, 2 * values)


LOAD_SIDE = 4096
""":func:`_time_decode`'s GEMM load: matmuls of a square matrix of this side by itself, in fp16 (the
tensor cores run it at bf16's rate, and every CUDA device has it), 64 MiB of device memory while it
runs."""

LOAD_DECODE_S = 4e-3
"""Decodes queued beside the load: as many as take about this long alone (at least 10)."""

LOAD_TIMES = 5.0
"""The load runs about this many times as long as its decodes alone, as a step's compute does more
than its decodes (so that the decodes run beside matmuls, not after them)."""

GATE_CYCLES = 10_000_000
"""A spin kernel of this many GPU cycles (about 5 ms) holds the stream before each timed batch of
:func:`_time_decode`, so that the launches are all queued before the first event: the rate is
measured while the host codes the weights (``CodedSlabs.build``), on a thread that may wait for a
core."""

RATE_REPEATS = 3
"""How many times the load alone, the load with the decodes and the decodes alone are each timed;
the medians are kept. With a load of about ``LOAD_TIMES * LOAD_DECODE_S`` (20 ms) that is some
0.2 s per codec at attach."""


def _time_decode(device: torch.device, stream: torch.cuda.Stream, run: Any,
                 nbytes: int) -> dict[str, float | None]:
    """Times ``run(stream)`` (one decode writing ``nbytes`` of bf16) alone on the idle device and beside a
    GEMM load (:data:`LOAD_SIDE`) on ``stream``: the load alone, then the same load with the decodes on
    a high-priority stream of their own (as ``CodedSlabs.open_transport``'s decode stream), each batch
    launched as a matmul ends so that it runs beside the next one, as a chunk's decode runs beside the
    model's kernels in a step. What the decodes add to the load is their cost there: the SMs they take
    from the load and the load's from them. :func:`_decode_rates` turns the timings into rates."""

    def seconds(fn: Any) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gate = getattr(torch.cuda, "_sleep", None)
        if gate is not None:  # the stream held while all is queued: launches a little late (a host busy
            # coding) do not stretch the timing, up to the gate's length
            gate(GATE_CYCLES)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    reps = 10
    alone = [seconds(lambda: [run() for _ in range(reps)]) / reps]
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(LOAD_SIDE, LOAD_SIDE, generator=g, device=device, dtype=torch.float16)
        y = torch.empty_like(x)
    except torch.cuda.OutOfMemoryError:
        log.info("ddo_blocks: no room for the GEMM load on %s; decode rate timed alone", device)
        return _decode_rates(nbytes, alone, [], [], 0)
    mm = lambda: torch.matmul(x, x, out=y)  # noqa: E731
    load, both = [], []
    try:
        mm()  # cuBLAS set-up
        per_mm = seconds(lambda: [mm() for _ in range(3)]) / 3
        decodes = max(reps, min(4096, math.ceil(LOAD_DECODE_S / alone[0]))) if alone[0] > 0 else reps
        matmuls = max(2, min(4096, math.ceil(LOAD_TIMES * decodes * alone[0] / per_mm))) if per_mm > 0 else 2
        side = torch.cuda.Stream(device, priority=-1)
        for _ in range(RATE_REPEATS):
            load.append(_beside(stream, side, mm, matmuls, run, 0))
            both.append(_beside(stream, side, mm, matmuls, run, decodes))
            alone.append(seconds(lambda: [run() for _ in range(reps)]) / reps)
    finally:
        _drop_cublas_workspaces(stream)
    return _decode_rates(nbytes, alone, load, both, decodes)


def _drop_cublas_workspaces(stream: torch.cuda.Stream) -> None:
    """Frees the cuBLAS workspaces PyTorch keeps per (handle, stream): the load's matmuls on the probe's
    own stream left one (32 MiB on the H200) allocated for the life of the process, outside any budget
    (a GPU test saw a peak 32 MiB over it). The stream's work is waited for first; blocks go back to
    the caching allocator, and other streams' workspaces are made again at their next matmul."""
    stream.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _beside(stream: torch.cuda.Stream, side: torch.cuda.Stream, mm: Any, matmuls: int, run: Any,
            decodes: int) -> float:
    """Seconds from a common start until ``matmuls`` calls of ``mm`` on ``stream`` and ``decodes``
    calls of ``run`` on ``side`` are all done, the decodes spread in batches launched as each matmul
    but the last ends. A spin kernel first holds ``stream`` while all of it is queued, so that
    neither stream waits on the host."""
    start, end, side_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    gate = getattr(torch.cuda, "_sleep", None)
    if gate is not None:
        gate(40_000 * (2 * matmuls + decodes))  # about 20 us a launch at 2 GHz
    start.record(stream)
    side.wait_event(start)
    for n in _batches(decodes, matmuls):
        mm()
        if n:
            done = torch.cuda.Event()
            done.record(stream)
            side.wait_event(done)
            for _ in range(n):
                run(side)
    end.record(stream)
    side_end.record(side)
    end.synchronize()
    side_end.synchronize()
    return max(start.elapsed_time(end), start.elapsed_time(side_end)) / 1e3


def _batches(decodes: int, matmuls: int) -> list[int]:
    """How many of ``decodes`` decodes :func:`_beside` launches as each of ``matmuls`` matmuls ends: as
    even as whole numbers allow, none after the last (there they would run after the load, not
    beside it)."""
    gaps = max(1, matmuls - 1)
    return [decodes * (i + 1) // gaps - decodes * i // gaps for i in range(gaps)] + [0] * (matmuls - gaps)


def _decode_rates(nbytes: int, alone_s: list[float], load_s: list[float], both_s: list[float],
                  decodes: int) -> dict[str, float | None]:
    """Rates (bytes per second) of a decode writing ``nbytes``, from repeated timings: ``alone`` from the
    median of ``alone_s`` (seconds of one decode on the idle device); ``under_load`` from the median over
    the repeats of ``both_s - load_s`` (what ``decodes`` decodes added to the load they ran beside),
    ``None`` where that is not positive (noise larger than the decodes' cost) or was not measured;
    ``planning``, the slower of the two, is what the planner weighs the decode with: an added time
    shorter than the decodes alone (the load hid part of them) gives the rate alone."""
    from statistics import median

    alone = median(alone_s) if alone_s else 0.0
    rate_alone = nbytes / alone if alone > 0 else None
    pairs = [b - a for a, b in zip(load_s, both_s)]
    added = median(pairs) / decodes if pairs and decodes > 0 else 0.0
    rate_load = nbytes / added if added > 0 and math.isfinite(added) else None
    known = [r for r in (rate_alone, rate_load) if r is not None]
    return {"alone": rate_alone, "under_load": rate_load, "planning": min(known) if known else None}
