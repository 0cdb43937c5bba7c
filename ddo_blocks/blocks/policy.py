"""Offload policies: what route, preset and VRAM budget each component of a stage gets.

A policy can be written three ways, everywhere a policy is accepted:

- a route name: ``"resident"``, ``"linear"``, ``"diffusers"``, ``"off"``;
- a mapping: ``{"route": "linear", "preset": "one_shot_fast", "vram_budget": "6GiB"}``, plus the
  route's own options (``{"route": "diffusers", "offload_type": "leaf_level"}``) and ``release``;
- an :class:`OffloadPolicy`.

A stage's policy is either one policy for all its components, or a mapping from component name to
policy (``{"text_encoder": "resident", "text_encoder_2": {"route": "diffusers"}}``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .. import routes
from ..budget import fmt_bytes, parse_bytes
from ..errors import ConfigError

POLICY_KEYS = ("route", "preset", "vram_budget", "release")
"""What every policy has; each route adds its own options (``routes.get(route).options``). A route
that needs the model's files (nvme) cannot place a block's already-loaded component: placing one
raises ConfigError pointing to ``ddo_blocks.from_pretrained(..., route="nvme")``."""

SYMBOLIC_BUDGETS = ("min", "auto")
"""Budgets resolved for each component when it is placed: ``"min"`` (its smallest plan) and
``"auto"`` (from the free device memory, ``ddo_blocks.autobudget``)."""


def _route_options(route: str) -> tuple[str, ...]:
    return routes.get(route).options


@dataclass(frozen=True)
class OffloadPolicy:
    """How one component is placed while its stage runs.

    Args:
        route: ``"linear"``, ``"resident"``, ``"diffusers"``, ``"sdnq"``, ``"off"`` (``nvme`` needs the
            model's files: ``from_pretrained``); ``python -m ddo_blocks presets`` lists them.
        preset: a preset of that route, or ``"auto"``.
        vram_budget: bytes, or a string such as ``"6GiB"``, for this component's weights on the device
            (activations come on top). ``None``: no limit. ``"min"``: the smallest plan; ``"auto"``: the
            budget picks itself from the free device memory and the first call's activations (as in
            ``ddo_blocks.offload``). Only the routes that stream (linear, sdnq) take a budget.
        release: after the stage, take the component's weights off the device so the next stage has the
            room (the handle is removed and placed again on the next run). Group offloading (route
            ``diffusers``) already leaves nothing on the device between calls, so it ignores this.
        options: the route's own options, e.g. ``{"offload_type": "leaf_level"}`` for ``diffusers``.

    Raises:
        ConfigError: unknown route, preset or option, or a malformed budget.
    """

    route: str = "linear"
    preset: str = "auto"
    vram_budget: int | str | None = None
    """Bytes after parsing, ``None`` (no limit), ``"min"`` or ``"auto"``."""
    release: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        routes.resolve(self.route, self.preset)  # names first: the errors list the valid ones
        if self.vram_budget in SYMBOLIC_BUDGETS:  # resolved for each component when it is placed
            if not routes.get(self.route).streams:
                raise ConfigError(f"vram_budget={self.vram_budget!r} is a budget of a route that streams "
                                  f"({', '.join(n for n, r in routes.REGISTRY.items() if r.streams)}); route "
                                  f"{self.route!r} does not stream: pass bytes, a size such as '6GiB', or None")
        else:
            object.__setattr__(self, "vram_budget", parse_bytes(self.vram_budget, what="vram_budget"))
        if not isinstance(self.release, bool):
            raise ConfigError(f"release={self.release!r} must be True or False")
        opts = dict(self.options)
        allowed = _route_options(self.route)
        unknown = sorted(set(opts) - set(allowed))
        if unknown:
            what = f"its options are {', '.join(allowed)}" if allowed else "it takes no options"
            raise ConfigError(
                f"route {self.route!r} does not take option(s) {', '.join(unknown)}; {what} "
                f"(every route takes {', '.join(POLICY_KEYS)})"
            )
        object.__setattr__(self, "options", _FrozenOptions(opts))

    @property
    def spec(self) -> routes.RouteSpec:
        return routes.get(self.route)

    def check(self, device: torch.device, module: nn.Module | None = None, name: str | None = None) -> None:
        """The route's own checks before anything runs: the options for the device (streams need
        CUDA), the budget, and the module when given (the same checks ``offload`` makes)."""
        spec = routes.for_module(self.route, self.preset, module) if module is not None else self.spec
        check = spec.check  # the route that will place it (linear auto hands SDNQ components to sdnq)
        if check is not None:
            check(module, self.vram_budget, device, preset=self.preset, options=dict(self.options), name=name)

    def offload_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ddo_blocks.offload`` (without module, device and component)."""
        return dict(route=self.route, preset=self.preset, vram_budget=self.vram_budget, **dict(self.options))

    def describe(self) -> str:
        bits = [self.route if self.preset == "auto" else f"{self.route}/{self.preset}"]
        if self.vram_budget is not None:
            symbolic = self.vram_budget in SYMBOLIC_BUDGETS
            bits.append(f"budget {self.vram_budget if symbolic else fmt_bytes(self.vram_budget)}")
        bits += [f"{k}={v}" for k, v in sorted(self.options.items())]
        if self.release:
            bits.append("release")
        return ", ".join(bits)

    @classmethod
    def parse(cls, value: Any, *, default: OffloadPolicy | None = None, where: str = "policy") -> OffloadPolicy:
        """Builds a policy from a route name, a mapping or a policy.

        Fields a mapping leaves out come from ``default`` (when the route is the same, or not given).
        """
        if isinstance(value, OffloadPolicy):
            return value
        if isinstance(value, str):
            try:
                routes.get(value)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if default is not None and default.route == value:
                return default
            return cls(route=value, release=default.release if default is not None else False)
        if isinstance(value, Mapping):
            data = dict(value)
            route = data.pop("route", None)
            base = default or cls()
            try:
                if route is not None and route != base.route:
                    base = cls(route=route, release=base.release)
                allowed = _route_options(base.route)
                unknown = sorted(set(data) - set(POLICY_KEYS) - set(allowed))
                if unknown:
                    raise ConfigError(
                        f"{', '.join(unknown)} is neither a policy key ({', '.join(POLICY_KEYS)}) nor an option "
                        f"of route {base.route!r}" + (f" ({', '.join(allowed)})" if allowed else "")
                    )
                options = {**dict(base.options), **{k: v for k, v in data.items() if k not in POLICY_KEYS}}
                return replace(
                    base,
                    preset=data.get("preset", base.preset),
                    vram_budget=data.get("vram_budget", base.vram_budget),
                    release=data.get("release", base.release),
                    options=options,
                )
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        raise ConfigError(
            f"{where}: a policy is a route name (e.g. 'resident'), a mapping such as "
            "{'route': 'linear', 'preset': 'one_shot_fast', 'vram_budget': '6GiB'} or an OffloadPolicy; "
            f"got {type(value).__name__}"
        )


class _FrozenOptions(dict):
    """A read-only dict, so a frozen policy stays frozen."""

    def _readonly(self, *a: Any, **k: Any) -> None:
        raise TypeError("OffloadPolicy.options is read-only; build a new policy with dataclasses.replace")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items(), key=str)))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __copy__(self) -> _FrozenOptions:
        return self

    def __deepcopy__(self, memo: dict) -> _FrozenOptions:
        return self


def parse_stage_policy(
    value: Any, components: list[str], defaults: dict[str, OffloadPolicy], *, stage: str
) -> dict[str, OffloadPolicy]:
    """Normalises a stage's policy to one :class:`OffloadPolicy` per component.

    Args:
        value: ``None`` (keep ``defaults``), one policy for every component, or a mapping from component
            name to policy.
        components: the stage's components that hold weights.
        defaults: each component's default policy.
        stage: the stage's name, for errors.

    Raises:
        ConfigError: a component the stage does not have, or a malformed policy.
    """
    if value is None:
        return dict(defaults)
    if isinstance(value, Mapping) and not isinstance(value, OffloadPolicy):
        keys = set(value)
        policy_like = keys & (set(POLICY_KEYS) | _all_route_options())
        named = keys & set(components)
        if named and not policy_like:
            if keys - set(components):
                raise ConfigError(
                    f"stage {stage!r} has no component(s) {', '.join(sorted(keys - set(components)))}; its "
                    f"components with weights are {', '.join(components)}"
                )
            return {
                c: OffloadPolicy.parse(value[c], default=defaults[c], where=f"stage {stage!r}, component {c!r}")
                if c in value else defaults[c]
                for c in components
            }
        if not policy_like:
            raise ConfigError(
                f"stage {stage!r}: {', '.join(sorted(map(str, keys)))} is neither a component of this stage "
                f"({', '.join(components)}) nor a policy key ({', '.join(POLICY_KEYS)}, or a route option)"
            )
    return {c: OffloadPolicy.parse(value, default=defaults[c], where=f"stage {stage!r}") for c in components}


def _all_route_options() -> set[str]:
    out: set[str] = set()
    for spec in routes.REGISTRY.values():
        out.update(spec.options)
    return out


# -------------------------------------------------------------------------------------------------
# Defaults per DDO pipeline preset (the table is routes.PIPELINE_PRESETS; docs/blocks.md shows it)
# -------------------------------------------------------------------------------------------------
STAGE_KINDS = routes.STAGE_KINDS
PIPELINE_PRESETS = tuple(routes.PIPELINE_PRESETS)


def stage_kind(stage: str) -> str:
    """``text_encoder``, ``denoise`` or ``decode``: which default a stage takes. Stages with other
    names (``vae_encoder``, ...) take the decode stage's (VAE-like) default."""
    return stage if stage in ("text_encoder", "denoise") else "decode"


def default_policy(stage: str, preset: str = "auto") -> OffloadPolicy:
    """The policy a component of ``stage`` gets when the caller leaves the stage out.

    Follows the original DDO: the text encoders and the VAE on Diffusers leaf offloading, the
    transformer on the route of ``preset`` (the linear route for its presets).
    """
    if preset not in routes.PIPELINE_PRESETS:
        raise ConfigError(f"unknown pipeline preset {preset!r}; valid: {', '.join(routes.PIPELINE_PRESETS)}")
    return OffloadPolicy(**routes.PIPELINE_PRESETS[preset][stage_kind(stage)])
