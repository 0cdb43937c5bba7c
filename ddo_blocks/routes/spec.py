"""What a route is: one :class:`RouteSpec` value (presets, options, factory, behaviour flags), the
:class:`Preset` values inside it, and the :class:`Engine` protocol every factory returns.

A route is registered once (``ddo_blocks.routes``); the API, the blocks, the CLI, the preset table
and the benchmark harness read the registry and never spell a route's name themselves.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import ConfigError


class HostMode(str, enum.Enum):
    """Where the streamed weights live on the host and how they reach the GPU."""

    PINNED_SLABS = "pinned_slabs"
    """Exact-size page-locked slabs; one asynchronous copy per unit straight to its GPU slot."""
    PAGEABLE_STAGED = "pageable_staged"
    """Ordinary (pageable) slabs; a background thread moves each unit through a bounded ring of
    small page-locked buffers."""
    DISK_STAGED = "disk_staged"
    """Streamed units are read from their safetensors files on every call (a RAM cache of up to
    ``ram_budget`` bytes excepted) by a reader pool into a bounded ring of page-locked buffers."""
    CALLER = "caller"
    """Nothing is moved: the caller owns placement."""
    RESIDENT = "resident"
    """Every weight on the device."""
    DIFFUSERS_HOOKS = "diffusers_hooks"
    """Diffusers group offloading owns placement: weights stay where they are between groups; with
    ``use_stream`` it keeps a page-locked copy of every tensor (``Tensor.pin_memory()``)."""


@dataclass(frozen=True)
class Preset:
    """One policy of a route.

    Args:
        route: the route this preset belongs to.
        name: the preset's name, as users pass it.
        summary: one line on what it does and when to pick it.
        host: how weights are held on the host and moved.
        keep_warm: keep pinned slabs for the process after ``remove()`` and reuse them when the same
            weights are offloaded again.
        staging_buffers / staging_buffer_mib / staging_threads: the staging ring (``PAGEABLE_STAGED``).
        staging_piece_kib: the piece of a ring buffer's fill that one copy thread takes at a time
            (0: an even share per thread). Pieces smaller than a share let the other threads finish
            the share of one that the OS parked for the Python thread. Rounded down to 64 bytes, at
            least 64 KiB.
        min_slots / max_slots: range of GPU slots the planner may choose.
        host_ram_ratio: host RAM the preset promises, as a multiple of the streamed weight bytes.
    """

    route: str
    name: str
    summary: str
    host: HostMode
    keep_warm: bool = False
    staging_buffers: int = 0
    staging_buffer_mib: int = 0
    staging_threads: int = 0
    staging_piece_kib: int = 0
    min_slots: int = 2
    max_slots: int = 4
    host_ram_ratio: str = "1.0x"

    @property
    def staging_bytes(self) -> int:
        return self.staging_buffers * self.staging_buffer_mib * 1024 * 1024


def staging_threads() -> int:
    """Threads of a staging ring: the cores, at most 16."""
    return max(1, min(16, os.cpu_count() or 1))


def refuse_unknown(route: str, options: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Raises ``ConfigError`` for options a route does not take (after it popped its own)."""
    if options:
        what = f"its options are {', '.join(allowed)}" if allowed else "it takes no options"
        raise ConfigError(f"route {route!r} does not take {', '.join(sorted(options))}; {what}")


@runtime_checkable
class Engine(Protocol):
    """What a route's factory returns: it places one component's weights and says what it did.

    ``report_sections()`` returns the report's route-specific fields by section (``plan``, ``setup``,
    ``runtime``, ``memory``, ``roofline``, ...); ``ddo_blocks.report`` merges them and knows no engine.
    """

    module: nn.Module
    device: torch.device

    def attach(self) -> None: ...

    def detach(self) -> None: ...

    @property
    def attached(self) -> bool: ...

    def report_sections(self) -> dict[str, dict[str, Any]]: ...

    def unit_infos(self) -> tuple[UnitInfo, ...]: ...


@dataclass(frozen=True)
class UnitInfo:
    """One unit of an offloaded component: the piece streamed as one copy (a block, or a block's
    child), and whether the plan streams it or keeps it resident."""

    name: str
    module: nn.Module
    streamed: bool
    nbytes: int
    """Its size in a slot: its tensors at aligned offsets."""


@dataclass(frozen=True)
class EngineRequest:
    """What ``offload()`` hands a route's factory, validated: the module, the preset name as asked
    (``auto`` included), the budget in bytes (``None``: no limit), the device, the route's own
    options, and the loader of a ``from_pretrained`` model (``None`` for a module in memory)."""

    module: nn.Module
    preset: str
    budget: int | None
    device: torch.device
    options: dict[str, Any]
    loader: Any = None
    measured: Any = None
    """What an earlier plan of this module measured (``streaming.plan.Measured``: compute per unit,
    and with a codec the units to code), which a streaming engine plans with instead of its prior
    (``OffloadHandle.replan``)."""
    component: str = ""
    """The component's name (``offload(component=...)``), for what the engine reports."""


EngineFactory = Callable[[EngineRequest], "tuple[Preset, Engine]"]


@dataclass(frozen=True)
class RouteSpec:
    """Everything about one route.

    Args:
        name: the route's name, as users pass it.
        presets: its presets, the default first.
        factory: builds the engine for an :class:`EngineRequest` and says which preset it chose.
        options: the route's own options (besides ``preset`` and ``vram_budget``), accepted by
            ``offload``, ``from_pretrained`` and block policies.
        auto: resolves ``preset="auto"`` from ``(streamed_bytes, total_ram)``; default: the first preset.
        auto_summary: the preset table's line for ``auto``, when it chooses.
        streams: streams units within a budget (``minimum_budget``, the CLI's ``--budget min`` apply).
        reads_files: the engine reads a ``from_pretrained`` model's weights from the files itself
            (others get an ordinary CPU module first).
        needs_files: only through ``from_pretrained`` (the engine streams from the files).
        device_hook: the blocks give its components an execution-device hook (weights that sit in host
            memory would make a pipeline create its latents on the CPU).
        releasable: a block policy's ``release`` takes its weights off the device after the stage.
        places_weights: the route moves weights (``off`` does not): a module that diffusers or
            accelerate already offloads is refused.
        holds_all: every weight stays on the device while attached (``resident``): what a
            pipeline-wide budget must count for it.
        min_extra: bytes the route needs beyond the streaming minimum (``vram_budget="min"`` adds them;
            the vmm route: its arena's rounding to whole chunks).
        codec_reserve: device bytes the route's ``codec`` option needs beside the slots, from
            ``(module, options, device)``, for ``vram_budget="min"`` and ``"auto"`` (default: the
            linear route's landing buffers, ``streaming.coded.reserve_bytes``).
        needs_cuda: the route has no CPU path (``vmm``): on the CPU it refuses with
            ``CudaNotAvailableError`` and the benchmarks skip its rows.
        check: validates a module, preset, budget, device and options before anything moves (blocks
            call it for every stage before the first runs).
        option_values: validates the values of the route's own options alone (``routes/values.py``),
            which ``offload`` calls before anything moves.
        claims / claims_auto_of: ``preset="auto"`` on route ``claims_auto_of`` picks this route for a
            module ``claims(module)`` is true of (the sdnq route claims quantized linear components).
    """

    name: str
    summary: str
    presets: tuple[Preset, ...]
    factory: EngineFactory
    options: tuple[str, ...] = ()
    auto: Callable[[int, int | None], Preset] | None = None
    auto_summary: str | None = None
    streams: bool = False
    reads_files: bool = False
    needs_files: bool = False
    device_hook: bool = False
    releasable: bool = False
    places_weights: bool = True
    holds_all: bool = False
    needs_cuda: bool = False
    min_extra: Callable[[nn.Module, dict[str, Any]], int] | None = None
    codec_reserve: Callable[[nn.Module, dict[str, Any], Any], int] | None = None
    check: Callable[..., None] | None = None
    option_values: Callable[[dict[str, Any]], None] | None = None
    claims: Callable[[nn.Module], bool] | None = None
    claims_auto_of: str | None = None
    preset_map: dict[str, Preset] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "preset_map", {p.name: p for p in self.presets})
