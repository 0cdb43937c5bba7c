"""Routes and presets: small frozen value objects, one registry, one command to list them.

A *route* is the runtime family that places a component's weights; a *preset* is the policy inside
it. ``python -m ddo_blocks presets`` prints this registry.
"""

from __future__ import annotations

import enum
import os
import platform
from dataclasses import dataclass, field

from .errors import ConfigError


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
    min_slots: int = 2
    max_slots: int = 4
    host_ram_ratio: str = "1.0x"
    aliases: tuple[str, ...] = field(default=())

    @property
    def staging_bytes(self) -> int:
        return self.staging_buffers * self.staging_buffer_mib * 1024 * 1024


def _staging_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


LINEAR_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "linear",
            "one_shot_fast",
            "pinned exact-size slabs (host RAM ~1.0x streamed weights), one async copy per unit, "
            "cyclic prefetch; slabs freed on remove()",
            HostMode.PINNED_SLABS,
        ),
        Preset(
            "linear",
            "warm_process",
            "as one_shot_fast, but the pinned slabs stay for the process and are reused without "
            "copying or pinning when the same weights are offloaded again",
            HostMode.PINNED_SLABS,
            keep_warm=True,
        ),
        Preset(
            "linear",
            "low_ram_safe",
            "no pinned copy of the weights: pageable slabs pass through a 4 x 64 MiB pinned staging "
            "ring filled by several threads (host RAM ~1.0x + 256 MiB)",
            HostMode.PAGEABLE_STAGED,
            staging_buffers=4,
            staging_buffer_mib=64,
            staging_threads=_staging_threads(),
            host_ram_ratio="1.0x + 256 MiB",
        ),
        Preset(
            "linear",
            "wsl_compat",
            "no large page-locked regions (WSL2 limits them): pageable slabs through a 4 x 16 MiB "
            "pinned staging ring",
            HostMode.PAGEABLE_STAGED,
            staging_buffers=4,
            staging_buffer_mib=16,
            staging_threads=_staging_threads(),
            host_ram_ratio="1.0x + 64 MiB",
        ),
        Preset(
            "linear",
            "off",
            "attach nothing: the caller owns placement (the report still records the component)",
            HostMode.CALLER,
            host_ram_ratio="unchanged",
        ),
    )
}

NVME_PRESETS: dict[str, Preset] = {
    "nvme_baseline": Preset(
        "nvme",
        "nvme_baseline",
        "models larger than RAM (from_pretrained only): streamed units are read from the safetensors "
        "files every call (O_DIRECT where possible) through a 4 x 64 MiB pinned ring; a static RAM "
        "cache of ram_budget bytes (default 0; auto: what available RAM allows) keeps some units",
        HostMode.DISK_STAGED,
        staging_buffers=4,
        staging_buffer_mib=64,
        staging_threads=_staging_threads(),
        host_ram_ratio="ram_budget + 256 MiB",
    ),
}

RESIDENT_PRESETS: dict[str, Preset] = {
    "resident": Preset(
        "resident",
        "resident",
        "every weight on the device; remove() puts them back where they were",
        HostMode.RESIDENT,
        host_ram_ratio="0x (weights on the GPU)",
    )
}

OFF_PRESETS: dict[str, Preset] = {
    "off": Preset("off", "off", "attach nothing; the caller owns placement", HostMode.CALLER, host_ram_ratio="unchanged")
}

DIFFUSERS_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "diffusers",
            "diffusers_offload_compat",
            "official diffusers group offloading, block_level, 1 block per group, use_stream on CUDA "
            "(options: offload_type, use_stream, record_stream, low_cpu_mem_usage, num_blocks_per_group, "
            "offload_to_disk_path)",
            HostMode.DIFFUSERS_HOOKS,
            host_ram_ratio="1.0x; ~2.6x stream",
        ),
        Preset(
            "diffusers",
            "diffusers_leaf_offload_compat",
            "official diffusers group offloading, leaf_level (every Linear/Conv/Embedding its own group), "
            "use_stream on CUDA",
            HostMode.DIFFUSERS_HOOKS,
            host_ram_ratio="1.0x; ~1.6x stream",
        ),
    )
}

ROUTES: dict[str, dict[str, Preset]] = {
    "linear": LINEAR_PRESETS,
    "resident": RESIDENT_PRESETS,
    "off": OFF_PRESETS,
    "diffusers": DIFFUSERS_PRESETS,
    "nvme": NVME_PRESETS,
}
"""Every route this build implements, with its presets (``auto`` is resolved at attach time)."""


def is_wsl() -> bool:
    """True under Windows Subsystem for Linux, where large page-locked regions are limited."""
    return "microsoft" in platform.release().lower() or "WSL_DISTRO_NAME" in os.environ


PIN_RAM_FRACTION = 0.5
"""``auto`` page-locks the streamed weights only when they are at most this fraction of physical RAM:
page-locked memory cannot be swapped or reclaimed, and the rest of the system needs the remainder."""


def resolve(route: str, preset: str, *, streamed_bytes: int = 0, total_ram: int | None = None) -> Preset:
    """Resolves a route and preset name to a :class:`Preset`.

    ``auto`` picks, for the linear route: ``wsl_compat`` under WSL; ``one_shot_fast`` when the streamed
    weights are at most half the machine's physical RAM (they are in RAM already; pinning them in place
    costs one slab more, but page-locked memory cannot be reclaimed); ``low_ram_safe`` otherwise.
    For the nvme route it is ``nvme_baseline`` with a RAM cache sized from the available RAM (the
    engine factory sizes it); for other routes, the route's only preset.

    Raises:
        ConfigError: unknown route or preset; the message lists the valid ones.
    """
    if not isinstance(route, str) or route not in ROUTES:
        raise ConfigError(f"unknown route {route!r}; valid routes: {', '.join(ROUTES)}")
    presets = ROUTES[route]
    if preset == "auto":
        if route != "linear":
            return next(iter(presets.values()))
        if is_wsl():
            return presets["wsl_compat"]
        if total_ram is not None and streamed_bytes > PIN_RAM_FRACTION * total_ram:
            return presets["low_ram_safe"]
        return presets["one_shot_fast"]
    if not isinstance(preset, str) or preset not in presets:
        valid = ["auto", *presets]
        raise ConfigError(f"unknown preset {preset!r} for route {route!r}; valid presets: {', '.join(valid)}")
    return presets[preset]


def describe() -> str:
    """The preset table, as printed by ``python -m ddo_blocks presets``."""
    wp = max(15, *(len(p.name) for presets in ROUTES.values() for p in presets.values()))
    wh = max(18, *(len(p.host_ram_ratio) for presets in ROUTES.values() for p in presets.values()))
    lines = [f"{'route':<10} {'preset':<{wp}} {'host RAM':<{wh}} what it does", "-" * (wp + wh + 90)]
    for route, presets in ROUTES.items():
        if route == "linear":
            lines.append(
                f"{route:<10} {'auto':<{wp}} {'-':<{wh}} wsl_compat under WSL, else one_shot_fast when the "
                "streamed weights are at most half the RAM, else low_ram_safe"
            )
        if route == "nvme":
            lines.append(
                f"{route:<10} {'auto':<{wp}} {'-':<{wh}} nvme_baseline with ram_budget (unless given) "
                "= half the available RAM, at most the streamed bytes"
            )
        for p in presets.values():
            lines.append(f"{route:<10} {p.name:<{wp}} {p.host_ram_ratio:<{wh}} {p.summary}")
    return "\n".join(lines)
