"""The trivial routes: ``resident`` (every weight on the device while the component runs) and
``off`` (nothing moves: the caller owns placement; the report still records the component)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ..budget import fmt_bytes
from ..errors import BudgetError, OffloadMemoryError
from .spec import Engine, EngineRequest, HostMode, Preset, RouteSpec, refuse_unknown


def device_bytes(module: nn.Module) -> int:
    """Every parameter and buffer of ``module``, in bytes: what ``resident`` puts on the device."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


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
        self.gpu_bytes = device_bytes(module)
        self._attached = False

    @property
    def attached(self) -> bool:
        return self._attached

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
        self._attached = True
        self.setup_s = time.perf_counter() - t0

    def detach(self) -> None:
        for p, dev in self._params:
            if p.device != dev:
                p.data = p.data.to(dev)
        for owner, name, dev in self._buffers:
            buf = owner._buffers.get(name)
            if buf is not None and buf.device != dev:
                owner._buffers[name] = buf.to(dev)
        self._attached = False

    def report_sections(self) -> dict[str, dict[str, Any]]:
        return {"plan": {"gpu_bytes": self.gpu_bytes}}

    def unit_infos(self) -> tuple:
        return ()


class OffEngine:
    """Attaches nothing: the caller owns placement. Exists so reports cover every component."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module = module
        self.device = device
        self.setup_s = 0.0
        self._attached = False

    @property
    def attached(self) -> bool:
        return self._attached

    def attach(self) -> None:
        self._attached = True

    def detach(self) -> None:
        self._attached = False

    def report_sections(self) -> dict[str, dict[str, Any]]:
        return {}

    def unit_infos(self) -> tuple:
        return ()


def check_resident(module: nn.Module | None, budget: int | None, device: torch.device, **_: Any) -> None:
    """Refuses a component whose weights exceed its budget (``BudgetError``), before anything moves."""
    if module is None or budget is None:
        return
    need = device_bytes(module)
    if need > budget:
        raise BudgetError(
            f"route='resident' puts all {fmt_bytes(need)} of {type(module).__name__} on {device}, more than "
            f"vram_budget={fmt_bytes(budget)}; raise the budget or use route='linear', which streams what does not fit"
        )


def _resident(req: EngineRequest) -> tuple[Preset, Engine]:
    refuse_unknown("resident", req.options, ())
    check_resident(req.module, req.budget, req.device)
    return RESIDENT.presets[0], ResidentEngine(req.module, req.device)


def _off(req: EngineRequest) -> tuple[Preset, Engine]:
    refuse_unknown("off", req.options, ())
    return OFF.presets[0], OffEngine(req.module, req.device)


RESIDENT = RouteSpec(
    name="resident",
    summary="every weight on the device",
    presets=(Preset("resident", "resident", "every weight on the device; remove() puts them back where they were",
                    HostMode.RESIDENT, host_ram_ratio="0x (weights on the GPU)"),),
    factory=_resident,
    device_hook=True,
    releasable=True,
    holds_all=True,
    check=check_resident,
)
OFF = RouteSpec(
    name="off",
    summary="attach nothing",
    presets=(Preset("off", "off", "attach nothing; the caller owns placement", HostMode.CALLER,
                    host_ram_ratio="unchanged"),),
    factory=_off,
    places_weights=False,
)
SPECS = (RESIDENT, OFF)
