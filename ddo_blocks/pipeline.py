"""``offload_pipeline()``: one line for a classic Diffusers pipeline (``FluxPipeline``,
``WanPipeline``, ``QwenImagePipeline``, ``StableDiffusion3Pipeline``, ...), as
``pipe.enable_model_cpu_offload()`` is one line, but within a VRAM budget and at the link's speed.

Every component with weights gets a policy by default, all of them inside the one ``vram_budget``:

- the denoiser (``transformer``, else ``unet``, else the largest component) streams on the linear
  route with what the others leave of the budget;
- each other component (text encoders, VAE) stays resident when it is small (at most a tenth of the
  budget), else streams on the linear route at its minimum budget (two slots of its largest unit
  plus what never streams).

The budget counts the weights each component keeps on the device between its calls (activations
come on top); a component on the ``diffusers`` route keeps none, but holds one group (a block, or a
layer at ``leaf_level``) while it runs, on top of the budget.

Any component can be given its own policy as a keyword (a route name, a mapping such as
``{"route": "linear", "vram_budget": "2GiB"}``, or an ``OffloadPolicy``). Everything is validated,
budgets included, before any weight moves. Components that hold weights in host memory get the
execution-device hook, so ``pipe._execution_device`` is the GPU and latents are made there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Self

import torch
from torch import nn

from . import routes
from .api import OffloadHandle, get_handle, minimum_budget, offload, resolve_device
from .budget import fmt_bytes, parse_bytes
from .errors import BudgetError, ConfigError, DdoError, OffloadStateError
from .report import Report
from .routes.resident import device_bytes
from .streaming.guards import foreign_offload

SMALL_FRACTION = 0.1
"""A component of at most this fraction of the budget stays resident by default."""

DENOISERS = ("transformer", "unet")

_PIPELINE_OFFLOADS = ("enable_group_offload", "enable_model_cpu_offload", "enable_sequential_cpu_offload")


@dataclass
class PipelineOffload:
    """The offload of a whole pipeline: one handle per component, one ``report()`` and ``remove()``."""

    pipeline: Any
    handles: dict[str, OffloadHandle]
    vram_budget: int | None
    device: torch.device
    policies: dict[str, Any] = field(default_factory=dict)
    arena: Any = None
    """The :class:`~ddo_blocks.Arena` its components share (``preset="vmm_fast"``), closed by ``remove()``."""

    def __post_init__(self) -> None:
        self._guarded: list[str] = []

    def guard(self) -> None:
        """Refuses diffusers' own offloading of the pipeline (``enable_group_offload``,
        ``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``) before it installs anything on
        any component, the ones kept resident included; ``remove()`` takes the guard away."""
        for name in _PIPELINE_OFFLOADS:
            if callable(getattr(self.pipeline, name, None)):
                self.pipeline.__dict__[name] = functools.partial(self._refuse, name)
                self._guarded.append(name)

    def _refuse(self, name: str, *args: Any, **kwargs: Any) -> None:
        raise OffloadStateError(
            f"{type(self.pipeline).__name__} is offloaded by ddo_blocks.offload_pipeline ({self!r}); "
            f"pipe.{name}() would move the same weights a second time. Call remove() on the offload_pipeline "
            "result first, or give a component route='diffusers' for diffusers' own offloading"
        )

    def report(self) -> dict[str, Report]:
        """Every component's report, by component name."""
        return {name: h.report() for name, h in self.handles.items()}

    @property
    def gpu_bytes(self) -> int:
        """The weights every component keeps on the device (resident parts and slots)."""
        return sum(r["plan"].get("gpu_bytes") or 0 for r in self.report().values())

    def remove(self) -> None:
        """Removes every component's offload and restores the pipeline."""
        from .execution_device import remove_device_hook

        errors: list[BaseException] = []
        for handle in self.handles.values():
            remove_device_hook(handle.module)
            if not handle.removed:
                try:
                    handle.remove()
                except DdoError as exc:  # remove the others; report the first
                    errors.append(exc)
        for name in self._guarded:
            if isinstance(self.pipeline.__dict__.get(name), functools.partial):
                del self.pipeline.__dict__[name]
        self._guarded = []
        if errors:
            raise errors[0]
        if self.arena is not None and not self.arena.members:
            self.arena.close()  # its chunks go back to the driver

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {h.route}/{h.preset.name}" for n, h in self.handles.items())
        return f"PipelineOffload({type(self.pipeline).__name__} on {self.device}: {parts})"


def _modules(pipe: Any) -> dict[str, nn.Module]:
    if isinstance(pipe, nn.Module):
        raise ConfigError(
            f"offload_pipeline() takes a pipeline, got the module {type(pipe).__name__}; use "
            "ddo_blocks.offload(module, ...) for one component"
        )
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise ConfigError(
            f"offload_pipeline() takes a Diffusers pipeline (with .components), got {type(pipe).__name__}"
        )
    from diffusers.modular_pipelines import ModularPipeline

    if isinstance(pipe, ModularPipeline):
        raise ConfigError(
            "offload_pipeline() is for classic pipelines; a ModularPipeline places its components per stage: "
            "wrap its blocks with ddo_blocks.wrap(blocks, ...) before init_pipeline()"
        )
    return {n: m for n, m in components.items() if isinstance(m, nn.Module)}


def _denoiser(modules: dict[str, nn.Module]) -> str:
    for name in DENOISERS:
        if name in modules:
            return name
    return max(modules, key=lambda n: device_bytes(modules[n]))


def _check_not_offloaded(modules: dict[str, nn.Module], given: dict[str, Any]) -> None:
    from .blocks.policy import OffloadPolicy

    for name, module in modules.items():
        if name in given and not OffloadPolicy.parse(given[name], where=f"component {name!r}").spec.places_weights:
            continue  # route='off': the caller keeps its own placement (another offloader's included)
        conflict = foreign_offload(module)
        if conflict is not None:
            raise OffloadStateError(
                f"pipeline component {name!r} ({type(module).__name__}) {conflict}; offload_pipeline() places every "
                "component itself: remove that offloading first (pipe.remove_all_hooks() for accelerate's)"
            )
        handle = get_handle(module)
        if handle is not None:
            raise OffloadStateError(
                f"pipeline component {name!r} is already offloaded ({handle!r}); call remove() on that handle "
                "first, or pass that component's policy to offload_pipeline() instead"
            )


def _device_bytes(policy: Any, module: nn.Module) -> int:
    """What a component keeps on the device between its calls under ``policy``: its budget on a
    streaming route (everything without one), everything on ``resident``, nothing on routes that
    keep no weights there between calls (``diffusers``: one group while it runs, ``off``)."""
    spec = routes.get(policy.route)
    if spec.streams:
        if policy.vram_budget == "auto":  # sized at attach from the free memory: at most everything
            return device_bytes(module)
        if policy.vram_budget == "min":
            return minimum_budget(module, units=policy.options.get("units", "auto"),
                                      codec=policy.options.get("codec", "off"))
        return policy.vram_budget if policy.vram_budget is not None else device_bytes(module)
    return device_bytes(module) if spec.holds_all else 0


def plan_policies(modules: dict[str, nn.Module], budget: int | None, preset: str,
                  given: dict[str, Any], elsewhere: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Each component's policy (see the module's docstring), every budget inside ``budget``;
    the components ``elsewhere`` (on another device) keep their own policy (``resident`` by
    default) and count against no budget here."""
    from .blocks.policy import OffloadPolicy

    denoiser = _denoiser(modules)
    policies: dict[str, OffloadPolicy] = {}
    for name, value in given.items():
        policies[name] = OffloadPolicy.parse(value, default=OffloadPolicy(), where=f"component {name!r}")
    for name in elsewhere:
        policies.setdefault(name, OffloadPolicy(route="resident"))
    if denoiser in elsewhere:
        raise ConfigError(f"the {denoiser} is what the pipeline's device computes: put it on device=, and other "
                          "components on other devices")
    auto = [n for n, p in policies.items() if p.vram_budget == "auto"]
    if auto and budget is not None:
        raise ConfigError(
            f"vram_budget='auto' for {', '.join(auto)} sizes a component from the device's free memory, which "
            f"a pipeline budget of {fmt_bytes(budget)} would not bound; give those components bytes or 'min', or "
            "leave the pipeline's vram_budget unset"
        )
    used: list[tuple[str, int, str]] = []  # (component, device bytes, route)
    for name, module in modules.items():
        if name == denoiser or name in elsewhere:
            continue
        if name not in policies:
            size = device_bytes(module)
            smallest = minimum_budget(module) if budget is not None else size
            if budget is None or size <= SMALL_FRACTION * budget or size <= smallest:
                policies[name] = OffloadPolicy(route="resident")
            else:
                policies[name] = OffloadPolicy(route="linear", vram_budget=smallest)
        used.append((name, _device_bytes(policies[name], module), policies[name].route))
    left = None if budget is None else budget - sum(n for _, n, _ in used)
    den = policies.get(denoiser)
    rest = None if left is None else max(left, 0)
    if den is None:
        den = policies[denoiser] = OffloadPolicy(route="linear", preset=preset, vram_budget=rest)
    elif rest is not None and den.vram_budget is None and routes.get(den.route).streams:
        den = policies[denoiser] = replace(den, vram_budget=rest)  # its route given, the budget what is left
    if budget is not None:
        need = (minimum_budget(modules[denoiser]) if routes.get(den.route).streams and den.vram_budget == rest
                else _device_bytes(den, modules[denoiser]))
        if left < need:
            others = ", ".join(f"{n} ({route}, {fmt_bytes(b)})" for n, b, route in used) or "nothing"
            leaves = fmt_bytes(left) if left > 0 else "nothing"
            raise BudgetError(
                f"vram_budget={fmt_bytes(budget)} leaves {leaves} for the {denoiser} ({den.describe()}) after "
                f"{others}, below the {fmt_bytes(need)} it needs; raise vram_budget to at least "
                f"{fmt_bytes(budget - left + need)}, or give the components routes that keep less on the "
                "device (e.g. text_encoder='diffusers')"
            )
    return policies


def _arena_policies(modules: dict[str, nn.Module], budget: int | None, preset: str, given: dict[str, Any],
                    where: dict[str, torch.device], dev: torch.device) -> dict[str, Any]:
    """``preset="vmm_fast"``: one :class:`~ddo_blocks.Arena` of ``budget`` for every component not given
    its own policy, and for those given a vmm policy (``transformer={"route": "vmm", "codec": "tiered"}``);
    what the others given their own policy keep on the device comes out of the arena's budget. The
    denoiser, called at every step, plans with the whole arena; each other component plans as it would
    on the linear route (resident when small, else its minimum budget): the chunks it holds go to the
    denoiser during the steps, and what the denoiser gives up for it comes back once per image."""
    from .blocks.policy import OffloadPolicy
    from .streaming.arena import Arena

    if budget is None:
        raise ConfigError(
            f"offload_pipeline(preset={preset!r}) shares one VRAM budget between the components through a CUDA "
            "virtual-memory arena: pass vram_budget= (bytes or a size such as '16GiB')"
        )
    policies = {n: OffloadPolicy.parse(v, default=OffloadPolicy(), where=f"component {n!r}") for n, v in given.items()}
    joins = {n for n, p in policies.items() if p.route == "vmm" and "arena" not in p.options and where.get(n, dev) == dev}
    outside = sum(_device_bytes(p, modules[n]) for n, p in policies.items() if where.get(n, dev) == dev and n not in joins)
    if budget == "auto":
        arena = Arena("auto", dev)
        arena.set_aside(outside)  # the free memory the components on their own policies will take
        budget = arena.budget
    elif outside >= budget:
        raise BudgetError(
            f"vram_budget={fmt_bytes(budget)} is taken by the components given their own policies "
            f"({fmt_bytes(outside)}); raise vram_budget or leave them to the arena"
        )
    else:
        arena = Arena(budget - outside, dev)
    denoiser = _denoiser(modules)
    for name in joins:  # a vmm policy of its own (a codec, a budget within the arena) joins the arena
        policies[name] = replace(policies[name], options={**policies[name].options, "arena": arena})
    for name, module in modules.items():
        if name in policies:
            continue
        own = None
        if name != denoiser:
            size, smallest = device_bytes(module), minimum_budget(module)
            own = None if size <= SMALL_FRACTION * budget or size <= smallest else "min"  # with the arena's rounding
        policies[name] = OffloadPolicy(route="vmm", preset=preset, vram_budget=own, options={"arena": arena})
    return {n: policies[n] for n in sorted(policies, key=lambda n: n == denoiser)}  # the denoiser plans last


def _component_devices(components: dict[str, Any], dev: torch.device) -> tuple[dict[str, Any], dict[str, torch.device]]:
    """The ``device`` key taken out of each component's policy mapping: (the policies, the devices)."""
    from .blocks.policy import OffloadPolicy

    policies, where = dict(components), {}
    for name, value in components.items():
        if isinstance(value, Mapping) and not isinstance(value, OffloadPolicy) and "device" in value:
            where[name] = resolve_device(value["device"])
            rest = {k: v for k, v in value.items() if k != "device"}
            policies[name] = rest or "resident"
    return policies, where


def offload_pipeline(pipe: Any, *, vram_budget: int | str | None = None, device: str | torch.device = "cuda",
                     preset: str = "auto", **components: Any) -> PipelineOffload:
    """Offloads every component of a classic Diffusers pipeline within one VRAM budget.

    Args:
        pipe: a ``DiffusionPipeline`` (``FluxPipeline``, ``WanPipeline``, ...), components on the CPU.
        vram_budget: bytes or a string such as ``"8GiB"`` for all the components' weights on the device
            together (activations come on top). ``None``: no limit (everything resident). With
            ``preset="vmm_fast"`` also ``"auto"``: the arena's budget from the free memory, phase by phase. A component's
            own policy may take ``"min"`` or ``"auto"`` (``transformer={"vram_budget": "auto"}``), the
            latter only without a pipeline budget.
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        preset: the linear route's preset for the denoiser; or ``"vmm_fast"``: every component (those
            given their own policy excepted) on the vmm route, sharing one :class:`~ddo_blocks.Arena` of
            ``vram_budget``, so each phase can use the pages the others are not using.
        **components: a policy for any component by name (``text_encoder_2="diffusers"``,
            ``transformer={"route": "linear", "vram_budget": "6GiB"}``); the others get the defaults.
            A mapping may put a component on another device (``text_encoder_2={"device": "cuda:1"}``,
            ``resident`` there unless it names a route): it computes there with its own policy, outside
            ``vram_budget``, its inputs moved to it and its outputs back, once per call.

    Returns:
        A :class:`PipelineOffload` (``report()``, ``remove()``, a context manager).

    Raises:
        ConfigError: not a classic pipeline, an unknown component, route, preset or option.
        BudgetError: the budget cannot hold the components as planned (the message gives the split).
        OffloadStateError: a component is already offloaded (by diffusers, accelerate or ddo_blocks).
    """
    modules = _modules(pipe)
    unknown = sorted(set(components) - set(modules))
    if unknown:
        raise ConfigError(
            f"{type(pipe).__name__} has no component(s) with weights named {', '.join(unknown)}; its components "
            f"with weights are {', '.join(modules) or 'none'}"
        )
    if not modules:
        raise ConfigError(f"{type(pipe).__name__} has no component with weights to offload")
    dev = resolve_device(device)
    components, where = _component_devices(components, dev)
    _check_not_offloaded(modules, components)
    arena_route = routes.route_of_preset(preset)
    if vram_budget == "min" or (vram_budget == "auto" and (arena_route is None or arena_route.name != "vmm")):
        raise ConfigError(
            f"offload_pipeline(vram_budget={vram_budget!r}): the pipeline's budget is bytes or a size such as "
            f"'8GiB' shared by its components; {vram_budget!r} is a budget of one component: pass it per component "
            f"(transformer={{'vram_budget': {vram_budget!r}}})"
        )
    budget = vram_budget if vram_budget == "auto" else parse_bytes(vram_budget, what="vram_budget")
    arena = None
    if arena_route is not None and arena_route.name == "vmm":
        policies = _arena_policies(modules, budget, preset, components, where, dev)
        arena = next((p.options["arena"] for p in policies.values() if "arena" in p.options), None)
    else:
        routes.resolve("linear", preset)
        policies = plan_policies(modules, budget, preset, components,
                                 frozenset(n for n, d in where.items() if d != dev))
    for name, pol in policies.items():
        try:
            pol.check(where.get(name, dev), modules[name], name)  # through the route that will place it
        except DdoError as exc:
            raise type(exc)(f"component {name!r}: {exc}") from None
    from .execution_device import add_device_hook, remove_device_hook

    handles: dict[str, OffloadHandle] = {}
    try:
        for name in policies:  # in the policies' order (the vmm preset plans the denoiser last)
            module, pol = modules[name], policies[name]
            own = where.get(name, dev)
            try:
                handles[name] = offload(module, device=own, component=name, **pol.offload_kwargs())
            except DdoError as exc:  # name the component; keep the class (BudgetError, ...)
                raise type(exc)(f"component {name!r}: {exc}") from exc
            if own != dev:
                add_device_hook(module, dev, compute_device=own)  # inputs there, outputs back
            elif pol.spec.device_hook:
                add_device_hook(module, dev)
    except BaseException:
        for name, handle in handles.items():
            remove_device_hook(modules[name])
            if not handle.removed:
                handle.remove()
        if arena is not None and not arena.members:
            arena.close()
        raise
    import logging

    logging.getLogger("ddo_blocks").info("offload_pipeline(%s): %s", type(pipe).__name__,
                                         "; ".join(f"{n}: {p.describe()}" for n, p in policies.items()))
    result = PipelineOffload(pipe, handles, budget, dev, policies, arena)
    result.guard()
    return result
