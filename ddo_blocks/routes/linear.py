"""The linear route: a component's repeated blocks stream through K device slots from host slabs
(pinned, or pageable through a staging ring), the rest stays resident; cyclic prefetch, a static
resident set from the planner. The default route."""

from __future__ import annotations

import os
import platform
from typing import Any

import psutil

from ..errors import ConfigError
from ..units import span_nbytes, split_units
from .spec import Engine, EngineRequest, HostMode, Preset, RouteSpec, refuse_unknown, staging_threads
from .values import check_values

PRESETS = (
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
        "no pinned copy of the weights: pageable slabs pass through a 4 x 32 MiB pinned staging "
        "ring filled by several threads in 1 MiB pieces (host RAM ~1.0x + 128 MiB)",
        HostMode.PAGEABLE_STAGED,
        staging_buffers=4,
        staging_buffer_mib=32,
        staging_threads=staging_threads(),
        staging_piece_kib=1024,
        host_ram_ratio="1.0x + 128 MiB",
    ),
    Preset(
        "linear",
        "wsl_compat",
        "no large page-locked regions (WSL2 limits them): pageable slabs through a 4 x 16 MiB "
        "pinned staging ring",
        HostMode.PAGEABLE_STAGED,
        staging_buffers=4,
        staging_buffer_mib=16,
        staging_threads=staging_threads(),
        staging_piece_kib=1024,
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


PIN_RAM_FRACTION = 0.5
"""``auto`` page-locks the streamed weights only when they are at most this fraction of physical RAM:
page-locked memory cannot be swapped or reclaimed, and the rest of the system needs the remainder."""


def is_wsl() -> bool:
    """True under Windows Subsystem for Linux, where large page-locked regions are limited."""
    return "microsoft" in platform.release().lower() or "WSL_DISTRO_NAME" in os.environ


def auto(streamed_bytes: int, total_ram: int | None) -> Preset:
    """``wsl_compat`` under WSL; ``one_shot_fast`` when the streamed weights are at most half the
    machine's physical RAM (they are in RAM already; pinning them in place costs one slab more, but
    page-locked memory cannot be reclaimed); ``low_ram_safe`` otherwise."""
    by_name = {p.name: p for p in PRESETS}
    if is_wsl():
        return by_name["wsl_compat"]
    if total_ram is not None and streamed_bytes > PIN_RAM_FRACTION * total_ram:
        return by_name["low_ram_safe"]
    return by_name["one_shot_fast"]


def option_values(options: dict[str, Any]) -> None:
    """The options' values, before anything moves (``routes/values.py``)."""
    from ..streaming.coded import CODECS

    check_values("linear", options, codecs=CODECS)


def check(module: Any = None, budget: Any = None, device: Any = None, *, options: dict[str, Any] | None = None,
          **_: Any) -> None:
    option_values(options or {})


def factory(req: EngineRequest) -> tuple[Preset, Engine]:
    from ..streaming import StreamingEngine, coded, plan, stores
    from .resident import OffEngine

    units = plan.check_granularity(req.options.pop("units", "auto"))
    codec = req.options.pop("codec", "off")
    graph = req.options.pop("graph", False)
    if not isinstance(graph, bool):
        raise ConfigError(f"graph={graph!r}: pass graph=True (replay steady calls as CUDA graphs) or graph=False")
    refuse_unknown("linear", req.options, ("units", "codec", "graph"))
    if req.preset == "auto":
        streamed = sum(span_nbytes(p) for u in split_units(req.module)[0] for _, p in u.params)
        chosen = auto(streamed, psutil.virtual_memory().total)
    else:
        chosen = SPEC.preset_map[req.preset]
    if chosen.host is HostMode.CALLER:
        return chosen, OffEngine(req.module, req.device)
    if coded.check_codec(codec, chosen) == "lossless":
        return chosen, _lossless(req, chosen, units, graph)
    if codec != "off":
        return chosen, StreamingEngine(req.module, chosen, req.budget, req.device, measured=req.measured,
                                       store=coded.CodedSlabs.for_codec(codec), loader=req.loader, units=units,
                                       reserve_bytes=coded.reserve_bytes(req.module, codec, req.device),
                                       link_bytes=coded.link_bytes_estimate(codec), graph=graph,
                                       variants=lambda e, compute: coded.measured_variants(e, compute, (codec,),
                                                                                           with_off=False))
    return chosen, StreamingEngine(req.module, chosen, req.budget, req.device, measured=req.measured, store=stores.HostSlabs,
                                   loader=req.loader, units=units, graph=graph)


def _lossless(req: EngineRequest, chosen: Any, units: str, graph: bool) -> Engine:
    """``codec="lossless"``: the codec and the units to code the planner chose (``coded.choose_lossless``
    at attach; a re-plan's measured choice when given), the report's ``codec`` section saying which and
    why."""
    from ..streaming import StreamingEngine, coded, stores

    measured = req.measured
    left_out: dict[str, str] = {}
    if measured is not None:
        # the measured mask says which units; no codec: no decode rate to weigh (the CPU engine), none
        codec, quarters = measured.codec or "off", coded.QUARTERS
        how, predicted = "the compute the second call measured", {}
    elif graph:
        codec, quarters, predicted = "off", 0, {}
        how = "graph=True: a CUDA graph cannot replay the decode stream yet"
    else:
        choice = coded.choose_lossless(req.module, chosen, req.budget, req.device, units)
        codec, quarters, predicted, left_out = choice
        how = "the planner's prior" if req.budget is not None else "no budget: nothing streams"
    section = {"requested": "lossless", "chosen": codec, "chosen_with": how,
               "candidates_predicted_s": predicted, "left_out": left_out}
    common = dict(measured=measured, loader=req.loader, units=units, graph=graph,
                  extra_sections=lambda: {"codec": dict(section)},
                  variants=lambda e, compute: coded.measured_variants(e, compute, coded.CODES, with_off=True))
    if codec == "off":
        return StreamingEngine(req.module, chosen, req.budget, req.device, store=stores.HostSlabs, **common)
    return StreamingEngine(req.module, chosen, req.budget, req.device, store=coded.CodedSlabs.for_codec(codec, quarters),
                           reserve_bytes=coded.reserve_bytes(req.module, codec, req.device),
                           link_bytes=coded.link_bytes_estimate(codec, quarters), **common)


SPEC = RouteSpec(
    name="linear",
    summary="stream the blocks that do not fit through GPU slots from host slabs",
    presets=PRESETS,
    factory=factory,
    options=("units", "codec", "graph"),
    check=check,
    option_values=option_values,
    auto=auto,
    auto_summary="wsl_compat under WSL, else one_shot_fast when the streamed weights are at most half the RAM, "
                 "else low_ram_safe",
    streams=True,
    reads_files=True,
    device_hook=True,
    releasable=True,
)
SPECS = (SPEC,)
