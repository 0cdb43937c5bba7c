"""The Diffusers compatibility route (``route="diffusers"``): official group offloading, validated up
front and removed cleanly.

It delegates to ``ModelMixin.enable_group_offload`` for diffusers models and to
``diffusers.hooks.apply_group_offloading`` for anything else (transformers text encoders). Diffusers
has no public way to undo group offloading; ``detach()`` removes the three hooks it installs
(``group_offloading``, ``layer_execution_tracker``, ``lazy_prefetch_group_offloading``) and puts every
parameter and buffer back on its original device with its original values, in ordinary (not
page-locked) memory.

Presets (``python -m ddo_blocks presets``):

- ``diffusers_offload_compat``: ``offload_type="block_level"``, ``num_blocks_per_group=1``,
  ``use_stream`` on the current CUDA device.
- ``diffusers_leaf_offload_compat``: ``offload_type="leaf_level"``, ``use_stream`` on the current CUDA
  device.

``use_stream`` is off by default, and refused, on a CUDA device that is not the current one
(``cuda:1`` beside ``cuda:0``): diffusers makes its copy stream and synchronizes on the current
device, so the copies would not overlap and each offload would wait for the other device.

Route options (each overrides the preset's value): ``offload_type``, ``use_stream``,
``record_stream``, ``low_cpu_mem_usage``, ``num_blocks_per_group``, ``offload_to_disk_path``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..budget import fmt_bytes
from ..errors import ConfigError, OffloadMemoryError, OffloadStateError
from ..streaming import guards
from ..units import own_copy
from .spec import Engine, EngineRequest, HostMode, Preset, RouteSpec

ROUTE = "diffusers"

CPU_ALIGN = 64
"""The alignment of PyTorch's CPU allocator: restored tensors live at such addresses."""

OPTION_NAMES = (
    "offload_type",
    "use_stream",
    "record_stream",
    "low_cpu_mem_usage",
    "num_blocks_per_group",
    "offload_to_disk_path",
)
OFFLOAD_TYPES = ("block_level", "leaf_level")

_HOOK_NAMES = ("lazy_prefetch_group_offloading", "layer_execution_tracker", "group_offloading")
"""Every hook ``apply_group_offloading`` registers, outermost first."""

PRESET_OPTIONS: dict[str, dict[str, Any]] = {
    "diffusers_offload_compat": {"offload_type": "block_level", "num_blocks_per_group": 1},
    "diffusers_leaf_offload_compat": {"offload_type": "leaf_level"},
}
"""What each preset sets; ``use_stream`` defaults to True on the current CUDA device, else False."""


@dataclass(frozen=True)
class GroupOffloadOptions:
    """The validated settings handed to diffusers (see ``apply_group_offloading``)."""

    offload_type: str
    use_stream: bool
    record_stream: bool = False
    low_cpu_mem_usage: bool = False
    num_blocks_per_group: int | None = None
    offload_to_disk_path: str | None = None

    def as_report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"offload_type": self.offload_type, "use_stream": self.use_stream}
        if self.offload_type == "block_level":
            out["num_blocks_per_group"] = self.num_blocks_per_group
        if self.record_stream:
            out["record_stream"] = True
        if self.low_cpu_mem_usage:
            out["low_cpu_mem_usage"] = True
        if self.offload_to_disk_path is not None:
            out["offload_to_disk_path"] = self.offload_to_disk_path
        return out


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"route 'diffusers' option {name}={value!r} must be True or False")
    return value


def check_options(preset: str, options: dict[str, Any], device: torch.device) -> GroupOffloadOptions:
    """Validates the diffusers route's options for ``device`` and merges them over the preset's.

    Everything diffusers would reject later (or silently change) is rejected here, before any
    weight moves.

    Raises:
        ConfigError: an unknown option or value, ``block_level`` without ``num_blocks_per_group``,
            ``record_stream`` without ``use_stream``, streams on a device without them.
    """
    chosen = _preset(preset)
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ConfigError(
            f"route 'diffusers' does not know option(s) {', '.join(unknown)}; its options are "
            f"{', '.join(OPTION_NAMES)}"
        )
    current = _is_current(device)
    merged: dict[str, Any] = {"use_stream": current, **PRESET_OPTIONS[chosen.name], **options}
    offload_type = merged["offload_type"]
    offload_type = getattr(offload_type, "value", offload_type)  # GroupOffloadingType is a str enum
    if offload_type not in OFFLOAD_TYPES:
        raise ConfigError(
            f"route 'diffusers' offload_type={offload_type!r} is not known; use 'block_level' or 'leaf_level'"
        )
    use_stream = _bool("use_stream", merged["use_stream"])
    record_stream = _bool("record_stream", merged.get("record_stream", False))
    low_cpu = _bool("low_cpu_mem_usage", merged.get("low_cpu_mem_usage", False))
    if use_stream and device.type != "cuda":
        raise ConfigError(
            f"route 'diffusers' use_stream=True needs a CUDA device (copies run on a side stream), but the "
            f"device is {str(device)!r}; pass use_stream=False"
        )
    if use_stream and not current:
        raise ConfigError(
            f"route 'diffusers' use_stream=True on {device}: diffusers' group offloading makes its copy stream "
            f"and waits at each offload on the current CUDA device (cuda:{_current_index()}), not on "
            f"{device}, so its copies would not overlap and every offload would wait for the other device; pass "
            f"use_stream=False (the default on a device that is not the current one), or make {device} current "
            "(torch.cuda.set_device) for the offload and for every call"
        )
    if record_stream and not use_stream:
        raise ConfigError("route 'diffusers' record_stream=True needs use_stream=True; pass both or neither")
    blocks = merged.get("num_blocks_per_group")
    if offload_type == "block_level":
        if blocks is None:
            raise ConfigError(
                "route 'diffusers' offload_type='block_level' needs num_blocks_per_group (e.g. 1); "
                "or use offload_type='leaf_level'"
            )
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ConfigError(f"route 'diffusers' num_blocks_per_group={blocks!r} must be a positive int")
        if use_stream and blocks != 1:
            raise ConfigError(
                f"route 'diffusers' with use_stream=True moves one block per group; num_blocks_per_group={blocks} "
                "would be changed to 1 by diffusers: pass num_blocks_per_group=1 or use_stream=False"
            )
    elif "num_blocks_per_group" in options:
        raise ConfigError(
            "route 'diffusers' num_blocks_per_group only applies to offload_type='block_level'; "
            "leaf_level makes every Linear/Conv/Embedding layer its own group"
        )
    else:
        blocks = None
    disk = merged.get("offload_to_disk_path")
    if disk is not None:
        if not isinstance(disk, (str, os.PathLike)):
            raise ConfigError(f"route 'diffusers' offload_to_disk_path must be a directory path, got {disk!r}")
        disk = os.fspath(disk)
        if os.path.exists(disk) and not os.path.isdir(disk):
            raise ConfigError(f"route 'diffusers' offload_to_disk_path={disk!r} exists and is not a directory")
    return GroupOffloadOptions(offload_type, use_stream, record_stream, low_cpu, blocks, disk)


def _current_index() -> int:
    """The current CUDA device's index (0 where CUDA cannot say: its default)."""
    try:
        return torch.cuda.current_device()
    except (RuntimeError, AssertionError):  # no usable CUDA (the checks before an attach run anywhere)
        return 0


def _is_current(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device and the current one: where diffusers' streams go (it makes
    them and synchronizes with ``torch.cuda`` calls that take no device)."""
    return device.type == "cuda" and (device.index is None or device.index == _current_index())


def check_module(module: nn.Module, name: str | None = None) -> None:
    """Checks that diffusers group offloading can be applied to ``module`` now.

    Raises:
        ConfigError: accelerate is missing, or the model class does not support group offloading.
        OffloadStateError: group offloading or accelerate offload hooks are already attached.
    """
    from diffusers.utils import is_accelerate_available

    label = name or type(module).__name__
    if not is_accelerate_available():
        raise ConfigError(
            "route 'diffusers' needs accelerate (diffusers moves hook inputs with it); "
            "`pip install accelerate`, or use route='linear'"
        )
    if getattr(type(module), "_supports_group_offloading", True) is False:
        raise ConfigError(
            f"{label} ({type(module).__name__}) does not support diffusers group offloading "
            "(_supports_group_offloading = False); use route='linear' or route='resident' for it"
        )
    conflict = guards.foreign_offload(module)
    if conflict is not None:
        raise OffloadStateError(f"{label} {conflict}")


class DiffusersGroupOffloadEngine:
    """Applies and removes diffusers group offloading on one component."""

    def __init__(self, module: nn.Module, preset: Preset, device: torch.device, options: GroupOffloadOptions):
        self.module = module
        self.preset = preset
        self.device = device
        self.options = options
        self.setup_s = 0.0
        self._orig: list[tuple[nn.Module, str, bool, torch.device, int]] = []
        self._disk_dir: str | None = None
        self._attached = False

    # -----------------------------------------------------------------------------------------
    def attach(self) -> None:
        t0 = time.perf_counter()
        self._orig = [
            (owner, name, is_param, tensor.device, tensor.data_ptr())
            for owner in self.module.modules()
            for is_param, table in ((True, owner._parameters), (False, owner._buffers))
            for name, tensor in table.items()
            if tensor is not None
        ]
        opts = self.options
        if opts.offload_to_disk_path is not None:
            # diffusers names its files after group ids and silently reuses a file that already exists,
            # even one of another model: give this offload a fresh folder of its own.
            os.makedirs(opts.offload_to_disk_path, exist_ok=True)
            self._disk_dir = tempfile.mkdtemp(prefix=f"{type(self.module).__name__}-", dir=opts.offload_to_disk_path)
        kwargs: dict[str, Any] = dict(
            onload_device=self.device,
            offload_device=torch.device("cpu"),
            offload_type=opts.offload_type,
            num_blocks_per_group=opts.num_blocks_per_group,
            use_stream=opts.use_stream,
            record_stream=opts.record_stream,
            low_cpu_mem_usage=opts.low_cpu_mem_usage,
            offload_to_disk_path=self._disk_dir,
        )
        try:
            enable = getattr(self.module, "enable_group_offload", None)
            if callable(enable):
                enable(**kwargs)
            else:
                from diffusers.hooks import apply_group_offloading

                apply_group_offloading(self.module, **kwargs)
        except Exception as exc:
            self._restore()
            if isinstance(exc, torch.OutOfMemoryError):
                raise OffloadMemoryError(
                    f"out of memory applying diffusers group offloading to {type(self.module).__name__}; "
                    "the module was restored; try low_cpu_mem_usage=True or route='linear'"
                ) from exc
            raise
        self._attached = True
        self.setup_s = time.perf_counter() - t0

    def detach(self) -> None:
        """Removes the hooks and restores every parameter and buffer (device, values, plain memory)."""
        self._restore()
        self._attached = False

    # -----------------------------------------------------------------------------------------
    def _groups(self) -> list[Any]:
        groups = []
        for sub in self.module.modules():
            registry = getattr(sub, "_diffusers_hook", None)
            hook = registry.get_hook("group_offloading") if registry is not None else None
            if hook is not None:
                groups.append(hook.group)
        return groups

    def _restore(self) -> None:
        from diffusers.hooks import HookRegistry

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        groups = self._groups()
        for group in groups:  # weights that went to disk come back from their files
            if getattr(group, "_is_offloaded_to_disk", False):
                import safetensors.torch

                saved = safetensors.torch.load_file(group.safetensors_file_path, device="cpu")
                for tensor, key in group.tensor_to_key.items():
                    tensor.data = saved[key]
        registry = HookRegistry.check_if_exists_or_initialize(self.module)
        for name in _HOOK_NAMES:
            registry.remove_hook(name, recurse=True)
        for owner, name, is_param, dev, ptr in self._orig:
            table = owner._parameters if is_param else owner._buffers
            tensor = table.get(name)
            if tensor is None:
                continue
            data = tensor.data
            if data.device != dev:
                data = data.to(dev)
            elif data.device.type == "cpu" and data.data_ptr() != ptr and (data.is_pinned() or data.data_ptr() % CPU_ALIGN):
                # Out of diffusers' pinned copies (so that memory can go), and out of tensors read back
                # from its disk files, which sit at the files' offsets: a parameter at an address PyTorch's
                # own allocator would not give (64 bytes) makes some CPU kernels take another path and
                # the restored module compute different bits. Tensors diffusers left in place stay
                # where the caller had them.
                data = own_copy(data)
            tensor.data = data
        self._orig = []
        if self._disk_dir is not None:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = None

    @property
    def attached(self) -> bool:
        return self._attached

    def report_sections(self) -> dict[str, dict[str, Any]]:
        """The route's settings, in the report's plan section."""
        return {"plan": self.options.as_report()}

    def unit_infos(self) -> tuple:
        return ()


def check(module: nn.Module | None = None, budget: int | None = None, device: torch.device | None = None, *,
          preset: str = "auto", options: dict[str, Any] | None = None, name: str | None = None) -> GroupOffloadOptions:
    """Everything diffusers would reject later, before any weight moves: the budget (group
    offloading cannot be bounded), the options for the device, the module (when given)."""
    if budget is not None:
        raise ConfigError(
            f"route 'diffusers' takes no vram_budget (got {fmt_bytes(budget)}): group offloading keeps one group "
            "(block_level) or one layer (leaf_level) on the device at a time and cannot be bounded; drop "
            "vram_budget, or use route='linear' to stay within a budget"
        )
    opts = check_options(_preset(preset).name, dict(options or {}), device or torch.device("cpu"))
    if module is not None:
        check_module(module, name)
    return opts


def _preset(name: str) -> Preset:
    from . import resolve

    return resolve(ROUTE, name)


def factory(req: EngineRequest) -> tuple[Preset, Engine]:
    chosen = _preset(req.preset)
    opts = check(req.module, req.budget, req.device, preset=chosen.name, options=req.options)
    req.options.clear()
    return chosen, DiffusersGroupOffloadEngine(req.module, chosen, req.device, opts)


PRESETS = (
    Preset(
        "diffusers",
        "diffusers_offload_compat",
        "official diffusers group offloading, block_level, 1 block per group, use_stream on the current CUDA device "
        "(options: offload_type, use_stream, record_stream, low_cpu_mem_usage, num_blocks_per_group, "
        "offload_to_disk_path)",
        HostMode.DIFFUSERS_HOOKS,
        host_ram_ratio="1.0x; ~2.6x stream",
    ),
    Preset(
        "diffusers",
        "diffusers_leaf_offload_compat",
        "official diffusers group offloading, leaf_level (every Linear/Conv/Embedding its own group), "
        "use_stream on the current CUDA device",
        HostMode.DIFFUSERS_HOOKS,
        host_ram_ratio="1.0x; ~1.6x stream",
    ),
)

SPEC = RouteSpec(
    name=ROUTE,
    summary="delegate to diffusers' official group offloading",
    presets=PRESETS,
    factory=factory,
    options=OPTION_NAMES,
    check=check,
)
SPECS = (SPEC,)
