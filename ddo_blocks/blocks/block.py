"""``OffloadBlock``: a Modular Diffusers block that runs a stage with its components offloaded.

The block wraps any stage (a ``ModularPipelineBlocks``: a preset's ``text_encoder``, ``denoise`` or
``decode`` step, or your own) and the components it manages. Before the stage runs it places each
component with ``ddo_blocks.offload`` (once; later runs reuse the handle); after the stage it releases
what the policy says and writes one :class:`~ddo_blocks.Report` per component into the pipeline state,
under ``state.get("ddo_reports")[stage][component]``.

It stays a *leaf* block: the wrapped stage is kept in a private attribute, not in ``sub_blocks``, so
workflow pruning (``get_execution_blocks``) cannot flatten it away.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from diffusers.modular_pipelines import (
    ConditionalPipelineBlocks,
    ModularPipelineBlocks,
    OutputParam,
    PipelineState,
)
from torch import nn

from ..api import OffloadHandle, get_handle, minimum_budget, offload, resolve_device
from ..budget import fmt_bytes
from ..errors import BudgetError, ConfigError, DdoError, OffloadStateError
from ..execution_device import add_device_hook, remove_device_hook, stage_device
from ..report import Report
from .policy import OffloadPolicy, default_policy, parse_stage_policy

REPORTS_KEY = "ddo_reports"
_POLICY_ATTR = "_ddo_block_policy"


def module_components(stage: ModularPipelineBlocks) -> list[str]:
    """The names of the stage's expected components whose type is a ``torch.nn.Module`` (the ones
    with weights), in the stage's order."""
    out = []
    for spec in stage.expected_components:
        hint = spec.type_hint
        if isinstance(hint, type) and issubclass(hint, nn.Module) and spec.name not in out:
            out.append(spec.name)
    return out


def _foreign_offload(module: nn.Module) -> str | None:
    from ..streaming.guards import foreign_offload

    return foreign_offload(module)


class OffloadBlock(ModularPipelineBlocks):
    """Runs ``block`` (one stage of a pipeline) with its components offloaded, one policy per component.

    Args:
        block: the stage to run, any ``ModularPipelineBlocks`` (e.g. ``FluxAutoBlocks().sub_blocks["denoise"]``).
        stage: the stage's name: the key of its reports and the default policy's kind
            (``text_encoder``, ``denoise``, ``decode``; other names take the decode default).
        policy: one policy for every component of the stage, or a mapping from component to policy;
            a policy is a route name, a mapping (``{"route": "linear", "vram_budget": "6GiB"}``) or an
            :class:`OffloadPolicy`. ``None``: the default of ``preset`` for this stage.
        components: the components to manage; default: every component of ``block`` that is a
            ``torch.nn.Module``.
        device: where the stage computes: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        preset: the pipeline preset whose defaults fill in what ``policy`` leaves out (see
            ``docs/blocks.md``).

    Raises:
        ConfigError: an unknown component, route, preset or option, or a route the device cannot run
            (for example ``use_stream`` on the CPU). Raised here, before anything runs.
        CudaNotAvailableError: ``device`` is CUDA on a machine without one.
    """

    def __init__(
        self,
        block: ModularPipelineBlocks | None = None,
        stage: str | None = None,
        policy: Any = None,
        components: list[str] | None = None,
        device: str | torch.device = "cuda",
        preset: str = "auto",
    ):
        super().__init__()
        if not isinstance(block, ModularPipelineBlocks):
            raise ConfigError(
                f"OffloadBlock needs the stage to wrap (a ModularPipelineBlocks, e.g. "
                f"FluxAutoBlocks().sub_blocks['denoise']), got {type(block).__name__}"
            )
        if isinstance(block, OffloadBlock):
            raise ConfigError(f"stage {block.stage!r} is already wrapped by an OffloadBlock; wrap the inner stage once")
        self._block = block
        self.stage = stage or self.default_stage or type(block).__name__
        self.device = resolve_device(device)
        self.preset = preset
        available = module_components(block)
        if components is None:
            names = available
        else:
            names = list(components)
            missing = [c for c in names if c not in available]
            if missing:
                raise ConfigError(
                    f"stage {self.stage!r} ({type(block).__name__}) has no component(s) with weights named "
                    f"{', '.join(missing)}; its components with weights are {', '.join(available) or 'none'}"
                )
        if not names:
            others = ", ".join(s.name for s in block.expected_components) or "none"
            raise ConfigError(
                f"stage {self.stage!r} ({type(block).__name__}) has no component with weights to offload "
                f"(its components: {others}); run it without an OffloadBlock"
            )
        base = default_policy(self.stage, preset)
        self.component_policies: dict[str, OffloadPolicy] = parse_stage_policy(
            policy, names, {c: base for c in names}, stage=self.stage
        )
        for name, pol in self.component_policies.items():
            try:
                pol.check(self.device)
            except ConfigError as exc:
                raise ConfigError(f"stage {self.stage!r}, component {name!r}: {exc}") from None
        self._handles: dict[str, OffloadHandle] = {}
        self._runs = 0
        self._moved_tensors = 0
        """State values moved onto this stage's device from another GPU's stage, all runs."""
        self._last_reports: dict[str, Report] = {}

    default_stage: str | None = None

    # ------------------------------------------------------------------------------------------
    # what the pipeline sees: the wrapped stage's interface, plus the reports
    # ------------------------------------------------------------------------------------------
    @property
    def block(self) -> ModularPipelineBlocks:
        """The wrapped stage."""
        return self._block

    @property
    def model_name(self) -> str | None:  # type: ignore[override]
        return self._block.model_name

    @property
    def description(self) -> str:
        placed = "; ".join(f"{c}: {p.describe()}" for c, p in self.component_policies.items())
        inner = self._block.description.strip().splitlines()[0] if self._block.description else type(self._block).__name__
        return f"{inner} [ddo_blocks on {self.device}: {placed}]"

    @property
    def expected_components(self):
        return self._block.expected_components

    @property
    def expected_configs(self):
        return self._block.expected_configs

    @property
    def inputs(self):
        return self._block.inputs

    @property
    def intermediate_outputs(self):
        outs = [o for o in self._block.intermediate_outputs if o.name != REPORTS_KEY]
        return [*outs, OutputParam(REPORTS_KEY, type_hint=dict,
                                   description="ddo_blocks reports: {stage: {component: Report}}")]

    # ------------------------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict) -> OffloadBlock:
        # ModularPipeline deep-copies its blocks (init_pipeline, pipe.blocks): copy the configuration,
        # never the handles (they hold the components themselves).
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        ModularPipelineBlocks.__init__(new)
        for key, value in self.__dict__.items():
            if key in ("_handles", "_last_reports"):
                setattr(new, key, {})
            elif key == "_runs":
                setattr(new, key, 0)
            elif key != "sub_blocks":
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    # ------------------------------------------------------------------------------------------
    # placing and releasing
    # ------------------------------------------------------------------------------------------
    def _modules(self, components: Any) -> dict[str, nn.Module]:
        found: dict[str, nn.Module] = {}
        for name in self.component_policies:
            module = getattr(components, name, None)
            if module is None:
                continue  # an optional component this pipeline does not load (e.g. a controlnet)
            if not isinstance(module, nn.Module):
                raise ConfigError(
                    f"stage {self.stage!r}: component {name!r} is a {type(module).__name__}, not a torch module; "
                    "only components with weights can be placed"
                )
            found[name] = module
        return found

    def _check(self, name: str, module: nn.Module, policy: OffloadPolicy) -> OffloadHandle | None:
        """Validates one component before anything moves; returns a handle to adopt, if any."""
        mine = self._handles.get(name)
        if mine is not None and mine.module is module and not mine.removed:
            return mine
        handle = get_handle(module)
        if handle is not None:
            owner = getattr(handle, _POLICY_ATTR, None)
            if owner == (policy, self.device):
                return handle  # placed by another DDO block with the same policy (a shared component)
            what = f"by another block with {owner[0].describe()}" if owner else f"by ddo_blocks.offload ({handle!r})"
            raise OffloadStateError(
                f"stage {self.stage!r}: component {name!r} ({type(module).__name__}) is already offloaded {what}; "
                f"this block wants {policy.describe()}. Give every stage that shares it the same policy, or "
                "remove the other offload first"
            )
        conflict = _foreign_offload(module)
        if conflict is not None:
            raise OffloadStateError(f"stage {self.stage!r}: component {name!r} ({type(module).__name__}) {conflict}")
        try:
            policy.check(self.device, module, name)
        except DdoError as exc:  # name the stage; keep the class (BudgetError, ...)
            raise type(exc)(f"stage {self.stage!r}, component {name!r}: {exc}") from None
        return None

    def validate(self, components: Any) -> None:
        """Checks every managed component against its policy without placing anything: offloads
        already attached, the route's own checks, budgets against the component's minimum, routes
        that need the model's files. Called for every block of a pipeline before its first stage runs."""
        for name, module in self._modules(components).items():
            policy = self.component_policies[name]
            self._check(name, module, policy)
            if get_handle(module) is not None:
                continue  # adopted: checked when it was placed
            spec = policy.spec
            where = f"stage {self.stage!r}, component {name!r}"
            if spec.needs_files:
                raise ConfigError(
                    f"{where}: route {spec.name!r} streams from the model's files, and a pipeline's component is "
                    "already loaded; load it with ddo_blocks.from_pretrained(..., route='nvme') and pass it to the "
                    "pipeline with route='off', or use route='linear'"
                )
            if spec.streams and policy.vram_budget not in (None, "min", "auto"):
                codec = policy.options.get("codec", "off")
                need = minimum_budget(module, units=policy.options.get("units", "auto"),
                                      # "lossless" runs uncompressed where its codes' landing buffers do not fit
                                      codec="off" if codec == "lossless" else codec)
                if policy.vram_budget < need:
                    raise BudgetError(
                        f"{where}: vram_budget={fmt_bytes(policy.vram_budget)} is below the minimum of "
                        f"{fmt_bytes(need)} ({need} bytes) for {type(module).__name__} on route {spec.name!r} "
                        "(its always-resident weights plus two slots of its largest unit); raise the budget "
                        "(ddo_blocks.minimum_budget(module) gives it; on the command line: --<stage>-budget min)"
                    )

    def place(self, components: Any) -> dict[str, OffloadHandle]:
        """Places every managed component (validating all of them first). Called before each run;
        reuses the handles of earlier runs. On an error, nothing this call placed stays placed."""
        modules = self._modules(components)
        adopt = {name: self._check(name, m, self.component_policies[name]) for name, m in modules.items()}
        for name in list(self._handles):  # a component swapped out of the pipeline: undo its offload
            if name not in modules or self._handles[name].module is not modules[name]:
                self._drop(name)
        created: list[str] = []
        try:
            for name, module in modules.items():
                policy = self.component_policies[name]
                handle = adopt[name]
                if handle is None:
                    try:
                        handle = offload(module, device=self.device, component=name, **policy.offload_kwargs())
                    except DdoError as exc:  # name the stage and component; keep the class (BudgetError, ...)
                        raise type(exc)(f"stage {self.stage!r}, component {name!r}: {exc}") from exc
                    setattr(handle, _POLICY_ATTR, (policy, self.device))
                    created.append(name)
                if policy.spec.device_hook:
                    add_device_hook(module, self.device)
                self._handles[name] = handle
        except BaseException:
            for name in created:
                self._drop(name)
            raise
        return dict(self._handles)

    def _drop(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None and not handle.removed:
            handle.remove()
            remove_device_hook(handle.module)

    def release(self) -> None:
        """Takes the weights of components whose policy says ``release`` off the device. The device
        hook stays, so the pipeline keeps resolving its execution device."""
        for name, policy in self.component_policies.items():
            handle = self._handles.get(name)
            if policy.release and handle is not None and policy.spec.releasable:
                self._handles.pop(name)
                if not handle.removed:
                    handle.remove()

    def remove(self) -> None:
        """Removes every offload this block made and restores the components."""
        for name in list(self._handles):
            self._drop(name)

    @property
    def handles(self) -> dict[str, OffloadHandle]:
        """The active handles, by component."""
        return dict(self._handles)

    # ------------------------------------------------------------------------------------------
    def _reports(self, stage_s: float, peak: int | None) -> dict[str, Report]:
        """Each component's report (as ``handle.report()``) with this block's ``stage`` section."""
        out = {}
        for name, handle in self._handles.items():
            rep = handle.report()
            rep.data["stage"] = {"name": self.stage, "run": self._runs, "seconds": stage_s, "device": str(self.device),
                                 "gpu_peak_allocated": peak, "policy": self.component_policies[name].describe(),
                                 "moved_in": self._moved_tensors}
            rep.data["runtime"]["stage_s"] = stage_s
            out[name] = rep
        return out

    def will_run(self, state: PipelineState) -> bool:
        """False when the wrapped stage is conditional and its trigger inputs select nothing (the
        ``vae_encoder`` of a text-to-image run): then nothing is placed."""
        inner = self._block
        if isinstance(inner, ConditionalPipelineBlocks):
            triggers = {n: state.get(n) for n in inner.block_trigger_inputs if n is not None}
            return inner.select_block(**triggers) is not None or inner.default_block_name is not None
        return True

    @torch.no_grad()
    def __call__(self, components: Any, state: PipelineState):
        moved = move_state(state, self.device)  # the outputs of a stage on another GPU, once
        if moved:
            self._moved_tensors += moved
        with stage_device(_pipeline_modules(components), self.device):
            return self._run(components, state)

    def _run(self, components: Any, state: PipelineState):
        if not self.will_run(state):
            return self._block(components, state)
        if self._runs == 0:  # errors before work: every stage of the pipeline, before this one runs
            validate(components)
        self.place(components)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            components, state = self._block(components, state)
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            stage_s = time.perf_counter() - t0
            self._runs += 1
            peak = torch.cuda.max_memory_allocated(self.device) if cuda else None
            reports = self._reports(stage_s, peak)
            self.release()
        self._last_reports = reports
        all_reports = dict(state.get(REPORTS_KEY) or {})
        all_reports[self.stage] = reports
        state.set(REPORTS_KEY, all_reports)
        return components, state


def _pipeline_modules(components: Any) -> list[nn.Module]:
    """The pipeline's components with weights (a ModularPipeline's ``components``)."""
    found = getattr(components, "components", None)
    return [m for m in (found.values() if isinstance(found, dict) else ()) if isinstance(m, nn.Module)]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type == "cuda" and value.device != device:
            return value.to(device, non_blocking=True)
        return value
    if isinstance(value, (list, tuple)):
        items = [_to(v, device) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            return type(value)(items) if isinstance(value, list) else tuple(items)
    return value


def move_state(state: Any, device: torch.device) -> int:
    """Moves the pipeline state's tensors that sit on another CUDA device (a stage on another GPU
    made them) to ``device``, a stage on a GPU; CPU tensors and other values stay. Returns how many
    values moved."""
    values = getattr(state, "values", None)
    if device.type != "cuda" or not isinstance(values, dict):
        return 0
    moved = 0
    for key, value in list(values.items()):
        new = _to(value, device)
        if new is not value:
            values[key] = new
            moved += 1
    return moved


class TextEncoderBlock(OffloadBlock):
    """The text-encoder stage: by default the encoders go on Diffusers leaf offloading and leave the
    device after the stage (``release``), so the transformer has the room."""

    default_stage = "text_encoder"


class DenoiseBlock(OffloadBlock):
    """The denoise stage: by default the transformer streams on the linear route."""

    default_stage = "denoise"


class DecodeBlock(OffloadBlock):
    """The decode stage: by default the VAE goes on Diffusers leaf offloading (``encode``/``decode``
    included: diffusers groups the VAE's submodules)."""

    default_stage = "decode"


STAGE_FORMS: dict[str, type[OffloadBlock]] = {
    "text_encoder": TextEncoderBlock,
    "denoise": DenoiseBlock,
    "decode": DecodeBlock,
}


def validate(pipe: Any) -> None:
    """Checks every DDO block of ``pipe`` (a ``ModularPipeline``) against its components before
    anything runs or moves: the errors ``place()`` would raise stage by stage, at once.

    Raises:
        ConfigError, BudgetError, OffloadStateError: as ``offload()`` would, naming stage and component.
    """
    for block in _walk(getattr(pipe, "_blocks", None)):
        if isinstance(block, OffloadBlock):
            block.validate(pipe)


def remove_offload(pipe: Any) -> int:
    """Removes every offload the DDO blocks of ``pipe`` (a ``ModularPipeline``) made and restores its
    components. Returns how many were removed."""
    removed = 0
    for module in getattr(pipe, "components", {}).values():
        if not isinstance(module, nn.Module):
            continue
        handle = get_handle(module)
        if handle is not None and getattr(handle, _POLICY_ATTR, None) is not None and not handle.removed:
            handle.remove()
            removed += 1
        remove_device_hook(module)
    blocks = getattr(pipe, "_blocks", None)
    for block in _walk(blocks):
        if isinstance(block, OffloadBlock):
            block._handles.clear()
    return removed


def _walk(block: Any):
    if block is None:
        return
    yield block
    for sub in getattr(block, "sub_blocks", {}).values():
        yield from _walk(sub)
