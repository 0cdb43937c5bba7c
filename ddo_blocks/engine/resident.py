"""The trivial engines: ``resident`` (every weight on the device) and ``off`` (nothing moves)."""

from __future__ import annotations

import time

import torch
from torch import nn

from ..errors import OffloadMemoryError


class ResidentEngine:
    """Moves every parameter and buffer to the device; ``detach`` puts each back where it was."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module = module
        self.device = device
        self.setup_s = 0.0
        self._params = [(p, p.device) for p in module.parameters()]
        self._buffers = [
            (owner, name, buf.device) for owner in module.modules() for name, buf in owner._buffers.items() if buf is not None
        ]
        self.gpu_bytes = sum(p.numel() * p.element_size() for p, _ in self._params)

    def attach(self) -> None:
        t0 = time.perf_counter()
        try:
            for p, _ in self._params:
                p.data = p.data.to(self.device)
            for owner, name, _ in self._buffers:
                owner._buffers[name] = owner._buffers[name].to(self.device)
        except torch.OutOfMemoryError as exc:
            self.detach()
            raise OffloadMemoryError(
                f"out of GPU memory placing {type(self.module).__name__} ({self.gpu_bytes} bytes) on "
                f"{self.device}; the module was restored; use route='linear' with a vram_budget"
            ) from exc
        self.setup_s = time.perf_counter() - t0

    def detach(self) -> None:
        for p, dev in self._params:
            if p.device != dev:
                p.data = p.data.to(dev)
        for owner, name, dev in self._buffers:
            buf = owner._buffers.get(name)
            if buf is not None and buf.device != dev:
                owner._buffers[name] = buf.to(dev)


class OffEngine:
    """Attaches nothing: the caller owns placement. Exists so reports cover every component."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module = module
        self.device = device
        self.setup_s = 0.0

    def attach(self) -> None:
        pass

    def detach(self) -> None:
        pass
