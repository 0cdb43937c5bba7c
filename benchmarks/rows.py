"""The rows of ``python -m benchmarks.run``: what ``--routes`` selects, and one spec (route, preset,
budget) per row.

Our rows come from the route registry (``ddo_blocks.routes``). ``ours:PRESET`` is a preset of a
streaming route that takes any module in memory (``spec.streams``, not ``spec.needs_files``: the
nvme route streams from the model's files and has ``python -m benchmarks.nvme``; not a route that
claims only some modules, as ``sdnq`` does quantized ones) and moves weights
(not ``HostMode.CALLER``), or ``auto``. ``ours`` (or such a route's name, ``linear``) runs one
preset per way of holding the weights (host mode and ``keep_warm``: the first such preset in the
registry's order), so a preset that only resizes another's staging ring (``wsl_compat``) is asked for
by name. The peers' rows (resident, diffusers group offloading, the original DDO) are named here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .measure import GIB, is_fraction, parse_size

OURS = "ours"

PEERS = {
    "resident": ["resident"],
    "diffusers": ["diffusers:block_level", "diffusers:leaf_level"],
    "ddo": ["ddo:one_shot_fast", "ddo:low_ram_safe"],
}
"""The peers' row families by group name."""

BUDGETED_PEERS = ("ddo",)
"""Peers that run at weight budgets (ours always do)."""

PRIORITY = (
    "resident",
    "ours:one_shot_fast",
    "diffusers:block_level",
    "diffusers:leaf_level",
    "ddo:one_shot_fast",
    "ours:low_ram_safe",
    "ddo:low_ram_safe",
    "ours:warm_process",
    "ours:vmm_fast",
)
"""The order row families run in, most important first (the time limit skips from the end); a family
not named here runs after these, in the order asked."""


# -------------------------------------------------------------------------------------------------
# our routes, from the registry
# -------------------------------------------------------------------------------------------------
def our_routes() -> list[Any]:
    """The registry's streaming routes that take any module in memory (not those that claim only
    some, as the sdnq route claims quantized ones: ``python -m benchmarks.sdnq`` benchmarks it), in
    the registry's order."""
    from ddo_blocks import routes

    return [s for s in routes.REGISTRY.values() if s.streams and not s.needs_files and s.claims is None]


def _moves_weights(preset: Any) -> bool:
    from ddo_blocks.routes import HostMode

    return preset.host is not HostMode.CALLER


def default_presets(route: Any) -> list[str]:
    """One preset of ``route`` per way of holding the weights (host mode, keep_warm): the first."""
    seen: dict[tuple[Any, bool], str] = {}
    for p in route.presets:
        if _moves_weights(p):
            seen.setdefault((p.host, p.keep_warm), p.name)
    return list(seen.values())


def our_presets() -> dict[str, Any]:
    """``{preset: route}`` for every ``ours:PRESET`` this harness runs (``auto`` included)."""
    found: dict[str, Any] = {}
    for route in our_routes():
        if route.auto is not None:
            found.setdefault("auto", route)
        found.update({p.name: route for p in route.presets if _moves_weights(p)})
    return found


def groups() -> dict[str, list[str]]:
    """Every group name ``--routes`` takes and the row families it stands for."""
    by_route = {r.name: [f"{OURS}:{p}" for p in default_presets(r)] for r in our_routes()}
    ours = [sel for sels in by_route.values() for sel in sels]
    return {"all": _prioritised([*PEERS["resident"], *ours, *PEERS["diffusers"], *PEERS["ddo"]]),
            OURS: ours, **by_route, **PEERS}


def _prioritised(selectors: list[str]) -> list[str]:
    order = {s: i for i, s in enumerate(PRIORITY)}
    return sorted(selectors, key=lambda s: (order.get(s.partition("@")[0], len(order)), selectors.index(s)))


def _files_hint(route: Any) -> str:
    """Why a registry route that streams from the model's files has no rows here."""
    if route is None or not route.needs_files:
        return ""
    return f"; route {route.name!r} streams from the model's files: python -m benchmarks.nvme benchmarks it"


REPLAN = "replan"
"""The ``+replan`` suffix of an ``ours`` row: ``handle.replan()`` after two calls, before the timing."""

GRAPH = "graph"
"""The ``+graph`` suffix of an ``ours`` row: ``graph=True`` (steady calls replayed as CUDA graphs)."""


def wants_graph(sub: str) -> bool:
    return GRAPH in sub.split("+")[1:]


def split_options(sub: str) -> tuple[str, str, bool]:
    """``PRESET[+CODEC][+replan][+graph]`` (``one_shot_fast+fixed+replan``) -> ``(PRESET, CODEC,
    replan)``; :func:`wants_graph` reads ``+graph``."""
    preset, *rest = sub.split("+")
    replan = REPLAN in rest
    codecs = [r for r in rest if r not in (REPLAN, GRAPH)]
    return preset, (codecs[0] if codecs else "off") if len(codecs) <= 1 else "+".join(codecs), replan


def split_codec(sub: str) -> tuple[str, str]:
    """``PRESET+CODEC`` (``one_shot_fast+fixed``: the preset with a codec) -> ``(PRESET, CODEC)``."""
    preset, codec, _ = split_options(sub)
    return preset, codec


def _check_ours(sub: str) -> None:
    from ddo_blocks.streaming.coded import CODECS

    preset, codec = split_codec(sub)
    if codec not in CODECS:
        raise SystemExit(f"unknown codec {codec!r} in {OURS}:{sub}; {OURS}:PRESET+CODEC takes {', '.join(CODECS)} "
                         f"(and +{REPLAN}: re-planned with measured compute before the timing)")
    if preset in our_presets():
        return
    from ddo_blocks import routes

    raise SystemExit(f"unknown preset {preset!r} in {OURS}:{preset}; {OURS}:PRESET takes "
                     f"{', '.join(our_presets())}{_files_hint(routes.route_of_preset(preset))}")


def _check(selector: str, known: set[str], names: list[str]) -> None:
    s, at, _ = selector.partition("@")
    route, _, sub = s.partition(":")
    if route == OURS and sub:
        _check_ours(sub)
    elif s not in known:
        from ddo_blocks import routes

        raise SystemExit(f"unknown route {s!r}; use {', '.join(names)} or {OURS}:PRESET"
                         f"{_files_hint(routes.REGISTRY.get(s))}")
    if at and route != OURS and route not in BUDGETED_PEERS:
        raise SystemExit(f"{selector!r}: only ours and ddo routes take budgets (ROUTE@B1/B2)")


def expand_routes(text: str) -> list[str]:
    """The row families of ``--routes`` (groups expanded, each checked, in :data:`PRIORITY` order)."""
    table = groups()
    out: list[str] = []
    for tok in [t.strip() for t in text.split(",") if t.strip()]:
        name, at, own = tok.partition("@")  # ROUTE@B1/B2: this route at its own budgets
        for s in table.get(name, [name]):
            if s + at + own not in out:
                out.append(s + at + own)
    known = {s for v in table.values() for s in v}
    for sel in out:
        _check(sel, known, sorted(set(table) | known))
    return _prioritised(out)


# -------------------------------------------------------------------------------------------------
# budgets and specs
# -------------------------------------------------------------------------------------------------
def parse_budget(tok: str, weight_bytes: int, minimum: int | None) -> tuple[str, int]:
    """(label, bytes) of one budget token: ``min``, a fraction of the weights (``0.25x``) or a size
    (a bare number is GiB)."""
    from ddo_blocks import ConfigError

    t = "".join(tok.split())
    if t.lower() == "min":
        if minimum is None:
            raise SystemExit("budget 'min' needs ddo_blocks")
        return "min", int(minimum)
    try:
        n = parse_size(t, weight_bytes)
    except (ValueError, ConfigError):
        raise SystemExit(f"cannot read budget {tok!r}: use 2 (GiB), 512MiB, 1.5GB, 0.25x or min") from None
    if is_fraction(t):
        return f"{float(t[:-1]):g}x", n
    return (t + "GiB" if t[-1:].isdigit() else t), n


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s)


def _spec(route: str, preset: str | None = None, budget: tuple[str, int] | None = None,
          offload_type: str | None = None, **extra: Any) -> dict[str, Any]:
    label, n = budget or (None, None)
    return {"route": route, "preset": preset, "budget": label, "budget_bytes": n, "offload_type": offload_type,
            **extra}


def _ours_specs(sub: str, budgets: list[tuple[str, int]]) -> list[dict[str, Any]]:
    preset, codec, replan = split_options(sub)
    route = our_presets()[preset]
    keep_warm = preset in route.preset_map and route.preset_map[preset].keep_warm
    return [_spec(OURS, preset, b, ddo_blocks_route=route.name, keep_warm=keep_warm, codec=codec, replan=replan,
                  graph=wants_graph(sub))
            for b in budgets]


def _ddo_env(budget_bytes: int) -> dict[str, str]:
    """The original DDO's budget: no automatic policy, the resident blocks' size in GiB."""
    return {"DDO_AUTO_BUDGET_POLICY": "off", "DDO_RESIDENT_MODULE_BUDGET_GB": f"{budget_bytes / GIB:.6g}"}


def _ddo_specs(preset: str, budgets: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [_spec("ddo", preset, b, env=_ddo_env(b[1])) for b in budgets]


def _family_specs(sel: str, budgets: list[tuple[str, int]], ddo_low: list[tuple[str, int]],
                  own: list[tuple[str, int]] | None) -> list[dict[str, Any]]:
    route, _, sub = sel.partition(":")
    if route == "resident":
        return [_spec("resident")]
    if route == OURS:
        return _ours_specs(sub, own or budgets)
    if route == "diffusers":
        return [_spec("diffusers", offload_type=sub)]
    return _ddo_specs(sub, own or (budgets if sub == "one_shot_fast" else ddo_low))


def make_specs(
    selectors: list[str],
    budgets: list[tuple[str, int]],
    ddo_low: list[tuple[str, int]],
    parse: Callable[[str], tuple[str, int]] | None = None,
) -> list[dict[str, Any]]:
    """One spec per row: each family at its budgets (``ROUTE@B1/B2``: its own, read by ``parse``),
    with its ``selector`` and ``id``; a row asked twice runs once."""
    specs = []
    for sel in selectors:
        sel, _, own_text = sel.partition("@")
        own = [parse(t) for t in own_text.split("/")] if own_text and parse else None
        specs += _family_specs(sel, budgets, ddo_low, own)
    unique: dict[str, dict[str, Any]] = {}
    for s in specs:
        sub = ((s["preset"] or s["offload_type"] or "") + (f"+{s['codec']}" if s.get("codec", "off") != "off" else "")
               + (f"+{REPLAN}" if s.get("replan") else "") + (f"+{GRAPH}" if s.get("graph") else ""))
        s["selector"] = f"{s['route']}:{sub}" if s["route"] != "resident" else "resident"
        s["id"] = _safe("-".join(str(x) for x in (s["route"], sub, s["budget"]) if x))
        unique.setdefault(s["id"], s)  # the same route and budget asked twice (ours:X and ours:X@B) runs once
    return list(unique.values())
