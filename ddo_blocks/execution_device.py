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
from accelerate.utils import send_to_device
from torch import nn


class ExecutionDeviceHook(ModelHook):
    """Carries ``execution_device`` and nothing else; ``_ddo_owned`` tells it from foreign hooks.

    With a ``compute_device`` (a component placed on another GPU than the pipeline's), it also moves
    the call's tensors there and the outputs back to where the inputs came from, so the pipeline
    keeps computing on its own device and the component on its own."""

    _ddo_owned = True
    no_grad = False

    def __init__(self, execution_device: torch.device, compute_device: torch.device | None = None):
        self.execution_device = execution_device
        self.compute_device = compute_device if compute_device != execution_device else None
        self._came_from: list[torch.device | None] = []

    def __repr__(self) -> str:
        moves = f", computes on {self.compute_device}" if self.compute_device is not None else ""
        return f"ddo_blocks.ExecutionDeviceHook({self.execution_device}{moves})"

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self.compute_device is None:
            return args, kwargs
        self._came_from.append(_first_device((args, kwargs)))
        return send_to_device(args, self.compute_device), send_to_device(kwargs, self.compute_device)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.compute_device is None or not self._came_from:
            return output
        back = self._came_from.pop()
        return send_to_device(output, back) if back is not None else output


def _first_device(tree: Any) -> torch.device | None:
    if isinstance(tree, torch.Tensor):
        return tree.device
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for item in tree:
            found = _first_device(item)
            if found is not None:
                return found
    return None


def add_device_hook(module: nn.Module, device: torch.device, compute_device: torch.device | None = None) -> None:
    """Gives ``module`` the hook (once); ``compute_device``: where the component itself computes,
    when not the pipeline's ``device``."""
    if not getattr(getattr(module, "_hf_hook", None), "_ddo_owned", False):
        add_hook_to_module(module, ExecutionDeviceHook(device, compute_device))


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
