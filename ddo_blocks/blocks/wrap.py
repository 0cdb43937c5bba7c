"""``wrap()``: a whole preset pipeline's stages wrapped with DDO blocks in one call."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.modular_pipelines import SequentialPipelineBlocks

from ..api import resolve_device
from ..errors import ConfigError
from .block import STAGE_FORMS, OffloadBlock, module_components
from .policy import STAGE_KINDS, OffloadPolicy, default_policy, parse_stage_policy


def wrap(
    blocks: SequentialPipelineBlocks,
    *,
    device: str | torch.device = "cuda",
    preset: str = "auto",
    vram_budget: Any = None,
    arena: Any = None,
    text_encoder: Any = None,
    denoise: Any = None,
    decode: Any = None,
    **stages: Any,
) -> SequentialPipelineBlocks:
    """Wraps every stage of ``blocks`` that has components with weights in an :class:`OffloadBlock`.

    Example::

        blocks = ddo_blocks.wrap(
            FluxAutoBlocks(),
            text_encoder={"route": "diffusers", "offload_type": "leaf_level"},
            denoise={"route": "linear", "preset": "one_shot_fast", "vram_budget": "6GiB"},
            decode="resident",
            device="cuda",
        )
        pipe = blocks.init_pipeline("black-forest-labs/FLUX.1-dev")

    Args:
        blocks: a preset's blocks (``FluxAutoBlocks()``, ``WanBlocks()``, ...) or any
            ``SequentialPipelineBlocks``. It is not changed: a wrapped copy is returned.
        device: where the stages compute.
        preset: the pipeline preset whose defaults fill the stages left out (``docs/blocks.md`` has
            the table): ``auto``, a linear preset, ``diffusers_offload_compat``,
            ``diffusers_leaf_offload_compat``, ``resident``, ``off`` or ``vmm_fast`` (every stage on
            the vmm route, sharing one arena).
        vram_budget: with stages on the vmm route, the budget of the one :class:`~ddo_blocks.Arena`
            they share (made here); or pass ``arena``.
        text_encoder, denoise, decode, **stages: each stage's policy: a route name, a mapping
            (``{"route": "linear", "preset": "one_shot_fast", "vram_budget": "6GiB"}`` plus route options),
            an :class:`OffloadPolicy`, or a mapping from component name to any of those. ``None``: the
            preset's default. A mapping may name the stage's own ``"device"`` (``text_encoder={"device":
            "cuda:1", "route": "resident"}``): that stage computes there, with its own routes and
            budgets, and the tensors it hands on move to the next stage's GPU at the boundary, once.

    A component that two stages share (the VAE of ``vae_encoder`` and ``decode``) gets one policy:
    the one of the named stage (``text_encoder``, ``denoise``, ``decode``) that has it.

    Raises:
        ConfigError: a stage or component the blocks do not have (the message lists the real ones),
            a stage without weights, conflicting policies for a shared component, or a bad policy.
    """
    if not isinstance(blocks, SequentialPipelineBlocks):
        raise ConfigError(
            f"wrap() takes a pipeline's SequentialPipelineBlocks (e.g. FluxAutoBlocks()), got "
            f"{type(blocks).__name__}; wrap a single stage with ddo_blocks.blocks.OffloadBlock(stage, ...)"
        )
    out = copy.deepcopy(blocks)
    real = list(out.sub_blocks)
    asked = {"text_encoder": text_encoder, "denoise": denoise, "decode": decode, **stages}
    devices: dict[str, Any] = {}
    for name, value in list(asked.items()):
        if isinstance(value, Mapping) and not isinstance(value, OffloadPolicy) and "device" in value:
            rest = {k: v for k, v in value.items() if k != "device"}
            devices[name] = resolve_device(value["device"])
            asked[name] = rest or None
    unknown = [s for s, v in asked.items() if v is not None and s not in real]
    if unknown:
        raise ConfigError(
            f"{type(blocks).__name__} has no stage(s) {', '.join(map(repr, unknown))}; its stages are "
            f"{', '.join(real)}"
        )
    with_weights = {name: module_components(b) for name, b in out.sub_blocks.items()}
    for name, value in asked.items():
        if value is not None and not with_weights[name]:
            comps = ", ".join(s.name for s in out.sub_blocks[name].expected_components) or "none"
            raise ConfigError(
                f"stage {name!r} has no component with weights to offload (its components: {comps}); "
                f"stages with weights: {', '.join(n for n, c in with_weights.items() if c)}"
            )
    for name, block in out.sub_blocks.items():
        if isinstance(block, OffloadBlock):
            raise ConfigError(f"stage {name!r} is already wrapped; wrap() the unwrapped blocks once")
    # Named stages decide the policy of the components they share with other stages.
    order = [s for s in STAGE_KINDS if s in with_weights] + [s for s in real if s not in STAGE_KINDS]
    chosen: dict[str, tuple[OffloadPolicy, str]] = {}
    per_stage: dict[str, dict[str, OffloadPolicy]] = {}
    for stage in order:
        names = with_weights[stage]
        if not names:
            continue
        defaults = {c: chosen[c][0] if c in chosen else default_policy(stage, preset) for c in names}
        policies = parse_stage_policy(asked.get(stage), names, defaults, stage=stage)
        for comp, pol in policies.items():
            if comp in chosen and chosen[comp][0] != pol:
                first = chosen[comp][1]
                raise ConfigError(
                    f"component {comp!r} is used by stages {first!r} ({chosen[comp][0].describe()}) and "
                    f"{stage!r} ({pol.describe()}); a component has one policy: set it on {first!r} only, "
                    "or give both the same"
                )
            chosen.setdefault(comp, (pol, stage))
        per_stage[stage] = policies
    where = {stage: devices.get(stage, device) for stage in per_stage}
    for comp in chosen if devices else ():
        users = [s for s in per_stage if comp in per_stage[s]]
        places = {str(resolve_device(where[s])) for s in users}
        if len(places) > 1:
            raise ConfigError(
                f"component {comp!r} is used by stages {', '.join(map(repr, users))} on different devices "
                f"({', '.join(sorted(places))}); a component lives on one device: give those stages the same device"
            )
    per_stage = _share_arena(per_stage, vram_budget, arena, device, where)
    for stage, policies in per_stage.items():
        form = STAGE_FORMS.get(stage, OffloadBlock)
        out.sub_blocks[stage] = form(out.sub_blocks[stage], stage=stage, policy=policies, device=where[stage],
                                     preset=preset)
    return out


LATE_JOIN_HEADROOM = 64 << 20
"""What an arena made by ``wrap`` keeps out of the plans: its decode stage's VAE joins after the
denoiser planned, and the VAE's buffers and weights in no unit land outside the arena."""


def _share_arena(per_stage: dict[str, dict[str, OffloadPolicy]], vram_budget: Any, arena: Any,
                 device: Any, where: dict[str, Any]) -> dict[str, dict[str, OffloadPolicy]]:
    """Gives every vmm policy without an arena of its own the one arena of this pipeline (``arena``,
    or one of ``vram_budget`` made here), on the pipeline's device; a stage on another device needs
    an arena of its own there."""
    from dataclasses import replace

    from ..streaming.arena import Arena

    needing = [(s, c) for s, pols in per_stage.items() for c, p in pols.items()
               if p.route == "vmm" and "arena" not in p.options]
    here = resolve_device(device) if needing else None
    for s, _ in needing:
        if resolve_device(where[s]) != here:
            raise ConfigError(
                f"stage {s!r} is on {where[s]} on the vmm route, and the pipeline's arena is on {here}: give that "
                f"stage an arena of its own there ({{'route': 'vmm', 'arena': ddo_blocks.Arena('8GiB', "
                f"device='{where[s]}')}}), or another route"
            )
    if (vram_budget is not None or arena is not None) and not needing:
        raise ConfigError("wrap(vram_budget=/arena=) is the arena of the stages on the vmm route, and no stage is on "
                          "it: pass preset='vmm_fast', or give those stages {'route': 'vmm'}")
    if not needing:
        return per_stage
    if arena is None:
        if vram_budget is None:
            raise ConfigError(
                f"the stages on the vmm route ({', '.join(sorted({s for s, _ in needing}))}) share one VRAM budget: "
                "pass wrap(..., vram_budget='16GiB') (or arena=ddo_blocks.Arena(...))"
            )
        arena = Arena(vram_budget, device, headroom=LATE_JOIN_HEADROOM)
    elif not isinstance(arena, Arena):
        raise ConfigError(f"wrap(arena=) takes a ddo_blocks.Arena, got {type(arena).__name__}")
    out = {s: dict(pols) for s, pols in per_stage.items()}
    for stage, comp in needing:
        pol = out[stage][comp]
        out[stage][comp] = replace(pol, options={**pol.options, "arena": arena})
    return out
