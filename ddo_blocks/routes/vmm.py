"""The VMM route: components share one VRAM budget through a CUDA virtual-memory arena
(``streaming.arena``). Each component streams as on the linear route (the same scheduler, pinned host
slabs and transport) with slots and resident units inside the arena at addresses that never change;
while a component runs it may take the chunks the others keep resident (theirs come back, at the
same addresses, on their next call), so every phase of a pipeline plans with the whole budget."""

from __future__ import annotations

from typing import Any

from ..budget import fmt_bytes
from ..errors import BudgetError, ConfigError
from .spec import Engine, EngineRequest, HostMode, Preset, RouteSpec, refuse_unknown
from .values import check_values

PRESETS = (
    Preset(
        "vmm",
        "vmm_fast",
        "weights in a CUDA virtual-memory arena shared by the components given the same Arena (one "
        "vram_budget for all): each call may use the chunks the others keep resident, which return at the "
        "same addresses on their next call; streaming as one_shot_fast (pinned slabs: host RAM ~1.0x weights; "
        "codec='fixed'/'tiered'/'huffman' as on the linear route, not 'lossless')",
        HostMode.PINNED_SLABS,
    ),
)


def _arena(req: EngineRequest) -> tuple[Any, int | None]:
    """The arena and the component's own plan budget within it (``None``: the whole arena)."""
    from ..streaming.arena import Arena

    arena = req.options.pop("arena", None)
    if arena is not None and not isinstance(arena, Arena):
        raise ConfigError(f"route='vmm': arena= takes a ddo_blocks.Arena, got {type(arena).__name__}")
    if arena is not None:
        if req.budget is not None and req.budget > arena.budget:
            raise ConfigError(
                f"route='vmm' with an Arena: vram_budget is what this component plans to use of the arena while it "
                f"runs, at most the arena's {fmt_bytes(arena.budget)}; it was {fmt_bytes(req.budget)} (leave it unset "
                "for the whole arena, or pass 'min')"
            )
        return arena, req.budget
    if req.budget is None:
        raise ConfigError(
            "route='vmm' needs a VRAM budget: pass vram_budget= (bytes or a size such as '16GiB'), or an "
            "arena=ddo_blocks.Arena(...) shared with the other components; without a budget use route='resident'"
        )
    arena = Arena(req.budget, req.device)
    arena.private = True
    return arena, None


def _fixed_bytes(module: Any, units: str, codec: str, device: Any) -> int:
    """What the component keeps on the device outside the arena: buffers, the weights in no unit and a
    codec's landing buffers (all PyTorch's)."""
    from ..streaming import coded, plan
    from ..units import split_units

    _, leftovers = split_units(module, "child" if units == "child" else "block")
    landing = coded.reserve_bytes(module, codec, device) if codec in coded.CODECS else 0
    return plan.buffer_bytes(module) + sum(p.numel() * p.element_size() for _, p in leftovers) + landing


LOSSLESS_REFUSED = ("codec='lossless' (the planner chooses the codec) is the linear route's; on the vmm route pass "
                    "codec='fixed', 'tiered' or 'huffman'")


def option_values(options: dict[str, Any]) -> None:
    """The options' values, before anything moves (``routes/values.py``)."""
    from ..streaming.coded import CODES

    if options.get("codec") == "lossless":
        raise ConfigError(LOSSLESS_REFUSED)
    check_values("vmm", options, codecs=("off", *CODES))


def check(module: Any = None, budget: Any = None, device: Any = None, *, options: dict[str, Any] | None = None,
          name: str | None = None, **_: Any) -> None:
    """Refuses the CPU (without a test arena) before anything moves; tells the arena a component that
    will join it, so that members planning before it leave its fixed bytes free."""
    from ..streaming.arena import Arena

    arena = (options or {}).get("arena")
    option_values(options or {})
    if isinstance(arena, Arena) and module is not None and name:
        opts = options or {}
        arena.expect(name, _fixed_bytes(module, opts.get("units", "auto"), opts.get("codec", "off"),
                                        device or arena.device))
    if getattr(device, "type", "cuda") != "cuda" and arena is None:
        from ..errors import CudaNotAvailableError

        raise CudaNotAvailableError(
            f"route='vmm' maps weights into CUDA virtual memory and needs a CUDA device, got {device}; use "
            "route='linear' on the CPU"
        )


def _unit_count(module: Any, units: str = "auto") -> int:
    """An upper bound of the units a plan may have (what the arena's alignment reserve counts)."""
    from ..units import split_units

    found, _ = split_units(module, "child" if units == "child" else "block")
    return sum(len(u.params) for u in found) + len(found)


def min_extra(module: Any, options: dict[str, Any]) -> int:
    """The arena's rounding beyond the streaming minimum (``vram_budget="min"``): with the given arena's
    chunks, or the default ones of a private arena."""
    from ..streaming.arena import CHUNK_BYTES, HOME_ALIGN, Arena

    arena = options.get("arena")
    n = _unit_count(module, options.get("units", "auto"))
    return arena.reserve_bytes(n) if isinstance(arena, Arena) else 2 * CHUNK_BYTES + HOME_ALIGN * n


def factory(req: EngineRequest) -> tuple[Preset, Engine]:
    from ..streaming import StreamingEngine, coded, plan, stores
    from ..streaming.arena import ArenaSlots, same_device

    units = plan.check_granularity(req.options.pop("units", "auto"))
    codec = req.options.pop("codec", "off")
    arena, own = _arena(req)
    refuse_unknown("vmm", req.options, ("arena", "units", "codec"))
    chosen = SPEC.presets[0] if req.preset == "auto" else SPEC.preset_map[req.preset]
    if coded.check_codec(codec, chosen) == "lossless":
        raise ConfigError(LOSSLESS_REFUSED)
    if not same_device(req.device, arena.device):
        raise ConfigError(f"the Arena is on {arena.device}; this component was asked on {req.device}: give it the "
                          "arena's device")
    landing = coded.reserve_bytes(req.module, codec, req.device)  # PyTorch's, outside the arena, like the leftovers
    fixed = _fixed_bytes(req.module, units, codec, req.device)
    reserve = arena.reserve_bytes(_unit_count(req.module, units)) + landing
    name = req.component or type(req.module).__name__
    budget = arena.plan_budget(name) if own is None else min(arena.plan_budget(name), own)
    if budget <= fixed:
        raise BudgetError(
            f"the arena's vram_budget={fmt_bytes(arena.budget)} leaves nothing for {type(req.module).__name__} after "
            f"the {fmt_bytes(arena.fixed_bytes)} its other members keep outside the arena; give the Arena a larger "
            "vram_budget"
        )
    what = "the arena's rounding to whole chunks" + (" and the codec's landing buffers" if landing else "")
    return chosen, StreamingEngine(req.module, chosen, budget, req.device, measured=req.measured,
                                   store=coded.CodedSlabs.for_codec(codec) if codec != "off" else stores.HostSlabs,
                                   loader=req.loader, units=units, reserve_bytes=reserve,
                                   link_bytes=coded.link_bytes_estimate(codec) if codec != "off" else None,
                                   reserve_for=(what, "or give the Arena a larger vram_budget"),
                                   slots=lambda engine: ArenaSlots(engine, arena, name, extra_fixed=landing),
                                   extra_sections=lambda: {"arena": arena.report_section()},
                                   variants=(lambda e, compute: coded.measured_variants(e, compute, (codec,), with_off=False))
                                   if codec != "off" else None)


SPEC = RouteSpec(
    name="vmm",
    summary="one VRAM budget for several components through a CUDA virtual-memory arena (pages move between phases)",
    presets=PRESETS,
    factory=factory,
    options=("arena", "units", "codec"),
    streams=True,
    device_hook=True,
    needs_cuda=True,
    min_extra=min_extra,
    check=check,
    option_values=option_values,
)
SPECS = (SPEC,)
