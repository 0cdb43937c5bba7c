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

from ..budget import fmt_bytes, parse_bytes
from ..errors import ConfigError
from ..presets import ROUTES, resolve

POLICY_KEYS = ("route", "preset", "vram_budget", "release")
ROUTE_OPTIONS: dict[str, tuple[str, ...]] = {"linear": ("units",), "nvme": ("ram_budget", "units")}
"""Options each route accepts besides the policy keys (the diffusers route's come from its engine).
The nvme route needs the model's files, so a block's already-loaded component cannot use it:
placing one raises ConfigError pointing to ``ddo_blocks.from_pretrained(..., route="nvme")``."""


def _route_options(route: str) -> tuple[str, ...]:
    if route == "diffusers":
        from ..engine.diffusers_compat import OPTION_NAMES

        return OPTION_NAMES
    return ROUTE_OPTIONS.get(route, ())


@dataclass(frozen=True)
class OffloadPolicy:
    """How one component is placed while its stage runs.

    Args:
        route: ``"linear"``, ``"resident"``, ``"diffusers"`` or ``"off"`` (``python -m ddo_blocks presets``).
        preset: a preset of that route, or ``"auto"``.
        vram_budget: bytes, or a string such as ``"6GiB"``, for this component's weights on the device
            (activations come on top). ``None``: no limit. Only the linear route streams within a budget.
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
    release: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        resolve(self.route, self.preset)  # names first: the errors list the valid ones
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

    def check_device(self, device: torch.device) -> None:
        """Checks the options that depend on the device (streams need CUDA) before anything runs."""
        if self.route == "diffusers":
            from ..engine.diffusers_compat import check_options

            check_options(self.preset, dict(self.options), device)
            if self.vram_budget is not None:
                raise ConfigError(
                    f"route 'diffusers' takes no vram_budget (got {fmt_bytes(self.vram_budget)}): group "
                    "offloading keeps one group on the device at a time and cannot be bounded; drop "
                    "vram_budget, or use route='linear' to stay within a budget"
                )

    def offload_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ddo_blocks.offload`` (without module, device and component)."""
        return dict(route=self.route, preset=self.preset, vram_budget=self.vram_budget, **dict(self.options))

    def describe(self) -> str:
        bits = [self.route if self.preset == "auto" else f"{self.route}/{self.preset}"]
        if self.vram_budget is not None:
            bits.append(f"budget {fmt_bytes(self.vram_budget)}")
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
            if value not in ROUTES:
                raise ConfigError(f"{where}: unknown route {value!r}; valid routes: {', '.join(ROUTES)}")
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
    for route in ROUTES:
        out.update(_route_options(route))
    return out


# -------------------------------------------------------------------------------------------------
# Defaults per DDO preset (documented in docs/blocks.md; keep the two in step)
# -------------------------------------------------------------------------------------------------
STAGE_KINDS = ("text_encoder", "denoise", "decode")
LINEAR_PRESET_NAMES = ("auto", "one_shot_fast", "low_ram_safe", "warm_process", "wsl_compat")
PIPELINE_PRESETS = (*LINEAR_PRESET_NAMES, "diffusers_offload_compat", "diffusers_leaf_offload_compat", "resident", "off")


def stage_kind(stage: str) -> str:
    """``text_encoder``, ``denoise`` or ``decode``: which default a stage takes. Stages with other
    names (``vae_encoder``, ...) take the decode stage's (VAE-like) default."""
    return stage if stage in ("text_encoder", "denoise") else "decode"


def default_policy(stage: str, preset: str = "auto") -> OffloadPolicy:
    """The policy a component of ``stage`` gets when the caller leaves the stage out.

    Follows the original DDO: the text encoders and the VAE on Diffusers leaf offloading, the
    transformer on the route of ``preset`` (the linear route for its presets).
    """
    if preset not in PIPELINE_PRESETS:
        raise ConfigError(f"unknown pipeline preset {preset!r}; valid: {', '.join(PIPELINE_PRESETS)}")
    kind = stage_kind(stage)
    if preset == "off":
        return OffloadPolicy(route="off")
    if preset == "resident":
        return OffloadPolicy(route="resident", release=kind == "text_encoder")
    leaf = OffloadPolicy(route="diffusers", preset="diffusers_leaf_offload_compat")
    if kind == "text_encoder":
        return replace(leaf, release=True)
    if kind == "decode":
        return leaf
    if preset in LINEAR_PRESET_NAMES:
        return OffloadPolicy(route="linear", preset=preset)
    return OffloadPolicy(route="diffusers", preset=preset)
