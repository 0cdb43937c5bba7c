"""The execution-device hook: an accelerate hook that only carries ``execution_device``.

``DiffusionPipeline._execution_device`` and ``ModularPipeline._execution_device`` ask the components'
accelerate hooks for the device when no component uses group offloading; without one, a component
whose weights sit in host memory (streamed units parked in host slabs) would make the pipeline
create its latents and prompt embeddings on the CPU. The hook changes no input or output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from torch import nn


class ExecutionDeviceHook(ModelHook):
    """Carries ``execution_device`` and nothing else; ``_ddo_owned`` tells it from foreign hooks."""

    _ddo_owned = True
    no_grad = False

    def __init__(self, execution_device: torch.device):
        self.execution_device = execution_device

    def __repr__(self) -> str:
        return f"ddo_blocks.ExecutionDeviceHook({self.execution_device})"


def add_device_hook(module: nn.Module, device: torch.device) -> None:
    """Gives ``module`` the hook (once)."""
    if not getattr(getattr(module, "_hf_hook", None), "_ddo_owned", False):
        add_hook_to_module(module, ExecutionDeviceHook(device))


def remove_device_hook(module: nn.Module) -> None:
    """Removes the hook if ``module`` has ours."""
    if getattr(getattr(module, "_hf_hook", None), "_ddo_owned", False):
        remove_hook_from_module(module)


@contextlib.contextmanager
def stage_device(modules: Any, device: torch.device) -> Iterator[None]:
    """While a stage runs, every component carrying our hook reports ``device``, so the pipeline's
    ``_execution_device`` (the first component's hook) is this stage's device when stages run on
    different GPUs; the hooks get their devices back after it. With one device it changes nothing."""
    changed = []
    for module in modules:
        hook = getattr(module, "_hf_hook", None)
        if isinstance(module, nn.Module) and getattr(hook, "_ddo_owned", False) and hook.execution_device != device:
            changed.append((hook, hook.execution_device))
            hook.execution_device = device
    try:
        yield
    finally:
        for hook, old in changed:
            hook.execution_device = old
