"""The route registry: every route this build implements, as one :class:`RouteSpec` each.

``get(name)`` finds a route (a ``ConfigError`` lists the ones that exist, and says when a name is a
route of the original DDO that is not rebuilt yet), ``resolve(route, preset)`` a preset,
``describe()`` prints the table of ``python -m ddo_blocks presets``. Adding a route is one file in
this folder that builds its spec and a line in ``_MODULES``.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError
from .spec import EngineRequest, HostMode, Preset, RouteSpec

_MODULES = ("linear", "resident", "diffusers", "nvme", "sdnq", "vmm")
"""The route files, in the order of the preset table."""

NOT_BUILT: dict[str, str] = {}
"""Routes of the original DDO not rebuilt yet: asking for one says so."""

NOT_BUILT_PRESETS: dict[str, str] = {}
"""Presets of the routes not rebuilt yet, and their route."""

REGISTRY: dict[str, RouteSpec] = {}

STAGE_KINDS = ("text_encoder", "denoise", "decode")

_LEAF = {"route": "diffusers", "preset": "diffusers_leaf_offload_compat"}


def _pipeline_presets() -> dict[str, dict[str, dict]]:
    """Each pipeline preset of the original DDO as a policy per stage kind: the text encoders and the
    VAE on Diffusers leaf offloading (the encoders leave the device after their stage), the
    transformer on the route that owns the preset."""
    table: dict[str, dict[str, dict]] = {}
    denoise = {"auto": {"route": "linear", "preset": "auto"}}
    denoise.update({p: {"route": "linear", "preset": p} for p in ("one_shot_fast", "low_ram_safe", "warm_process",
                                                                  "wsl_compat")})
    denoise.update({p: {"route": "diffusers", "preset": p} for p in ("diffusers_offload_compat",
                                                                     "diffusers_leaf_offload_compat")})
    for name, policy in denoise.items():
        table[name] = {"text_encoder": {**_LEAF, "release": True}, "denoise": policy, "decode": dict(_LEAF)}
    table["resident"] = {"text_encoder": {"route": "resident", "release": True}, "denoise": {"route": "resident"},
                         "decode": {"route": "resident"}}
    table["off"] = {kind: {"route": "off"} for kind in STAGE_KINDS}
    # one arena for every stage (wrap() makes it from its vram_budget): the text encoders, called
    # once per image, plan at their minimum; the transformer and the VAE with the whole arena
    vmm = {"route": "vmm", "preset": "vmm_fast"}
    table["vmm_fast"] = {"text_encoder": {**vmm, "vram_budget": "min"}, "denoise": dict(vmm), "decode": dict(vmm)}
    return table


PIPELINE_PRESETS = _pipeline_presets()
"""``{pipeline preset: {stage kind: policy fields}}`` for ``wrap(..., preset=)`` and the CLI."""


def register(spec: RouteSpec) -> RouteSpec:
    """Adds a route to the registry (a route file calls it once)."""
    REGISTRY[spec.name] = spec
    return spec


def _load() -> None:
    for name in _MODULES:
        for spec in importlib.import_module(f".{name}", __name__).SPECS:
            register(spec)


def names() -> list[str]:
    """Every route, in the order of the preset table."""
    return list(REGISTRY)


def get(route: str) -> RouteSpec:
    """The route called ``route``.

    Raises:
        ConfigError: no such route; the message lists the routes that exist.
    """
    spec = REGISTRY.get(route) if isinstance(route, str) else None
    if spec is None:
        later = NOT_BUILT.get(route) if isinstance(route, str) else None
        if later is not None:
            raise ConfigError(f"route {route!r} ({later}) is not rebuilt yet in ddo_blocks; valid routes: "
                              f"{', '.join(REGISTRY)}")
        raise ConfigError(f"unknown route {route!r}; valid routes: {', '.join(REGISTRY)}")
    return spec


def resolve(route: str, preset: str, *, streamed_bytes: int = 0, total_ram: int | None = None) -> Preset:
    """Resolves a route and preset name to a :class:`Preset` (``auto`` as the route decides, from the
    streamed bytes and the machine's RAM where it depends on them).

    Raises:
        ConfigError: unknown route or preset; the message lists the valid ones.
    """
    spec = get(route)
    if preset == "auto":
        return spec.auto(streamed_bytes, total_ram) if spec.auto is not None else spec.presets[0]
    if isinstance(preset, str) and preset in spec.preset_map:
        return spec.preset_map[preset]
    valid = ["auto", *spec.preset_map]
    elsewhere = [s.name for s in REGISTRY.values() if isinstance(preset, str) and preset in s.preset_map]
    hint = f"; {preset!r} is a preset of route {elsewhere[0]!r}" if elsewhere else ""
    if not elsewhere and preset in NOT_BUILT_PRESETS:
        hint = f"; {preset!r} belongs to {NOT_BUILT[NOT_BUILT_PRESETS[preset]]}, which is not rebuilt yet"
    raise ConfigError(f"unknown preset {preset!r} for route {route!r}; valid presets: {', '.join(valid)}{hint}")


def for_module(route: str, preset: str, module: Any) -> RouteSpec:
    """The route that places ``module``: ``route``, unless ``preset="auto"`` and another route claims
    the module from it (an SDNQ-quantized component asked on the linear route goes to ``sdnq``)."""
    spec = get(route)
    if preset == "auto":
        for other in REGISTRY.values():
            if other.claims_auto_of == spec.name and other.claims is not None and other.claims(module):
                return other
    return spec


def route_of_preset(preset: str) -> RouteSpec | None:
    """The route that has a preset of this name (preset names are unique across routes)."""
    return next((s for s in REGISTRY.values() if preset in s.preset_map), None)


def describe(*, markdown: bool = False, width: int = 110) -> str:
    """The preset table, as printed by ``python -m ddo_blocks presets`` (``--markdown``: the
    README's table, which a test keeps equal to this one). Plain text wraps the last column to
    ``width`` characters."""
    rows = []
    for spec in REGISTRY.values():
        if spec.auto_summary:
            rows.append((spec.name, "auto", "-", spec.auto_summary))
        rows += [(spec.name, p.name, p.host_ram_ratio, p.summary) for p in spec.presets]
    if markdown:
        lines = ["| route | preset | host RAM | what it does |", "|---|---|---|---|"]
        lines += [f"| `{r}` | `{p}` | {h} | {what} |" for r, p, h, what in rows]
        return "\n".join(lines)
    import textwrap

    wr, wp, wh = (max(len(r[i]) for r in rows) for i in range(3))
    lead = wr + wp + wh + 6
    head = f"{'route':<{wr}}  {'preset':<{wp}}  {'host RAM':<{wh}}  what it does"
    lines = [head, "-" * width]
    for r, p, h, what in rows:
        parts = textwrap.wrap(what, max(30, width - lead))
        lines.append(f"{r:<{wr}}  {p:<{wp}}  {h:<{wh}}  {parts[0]}")
        lines += [" " * lead + part for part in parts[1:]]
    return "\n".join(lines)


_load()

__all__ = ["REGISTRY", "EngineRequest", "HostMode", "Preset", "RouteSpec", "describe", "get", "names", "register",
           "resolve", "route_of_preset"]
