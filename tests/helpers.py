"""Shared test helpers: snapshots of a module's weights and the budgets that span a model."""

from __future__ import annotations

import torch

import ddo_blocks
from ddo_blocks import _native
from ddo_blocks.units import split_units, tensor_nbytes


def snapshot(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Parameter, torch.Tensor, torch.device]]:
    """Each parameter object, a copy of its values and its device."""
    return {n: (p, p.detach().cpu().clone(), p.device) for n, p in module.named_parameters()}


def assert_restored(module: torch.nn.Module, snap) -> None:
    """Same Parameter objects, bit-identical values, same devices, no sharing with offload memory."""
    now = dict(module.named_parameters())
    assert now.keys() == snap.keys()
    for name, (param, values, device) in snap.items():
        assert now[name] is param, f"{name}: parameter object replaced"
        assert param.device == device, f"{name}: on {param.device}, was on {device}"
        assert torch.equal(param.detach().cpu(), values), f"{name}: values changed"


def budgets(module: torch.nn.Module, granularity: str = "block") -> dict[str, int | None]:
    """The budgets from 'everything streamed' (the planner's minimum) to 'everything resident'."""
    units, leftovers = split_units(module, granularity)
    base = sum(tensor_nbytes(p) for _, p in leftovers) + sum(tensor_nbytes(b) for b in module.buffers())
    total = base + sum(_native.layout_unit([tensor_nbytes(p) for _, p in u.params]).nbytes for u in units)
    minimum = ddo_blocks.minimum_budget(module, units=granularity)
    return {
        "all_streamed": minimum,
        "half": (minimum + total) // 2,
        "all_resident": total,
        "unlimited": None,
    }


def cuda_reference(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, dict]:
    """The model's all-resident output on the GPU (the model goes back to the CPU) and the inputs
    moved to the GPU."""
    xc = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    model.to("cuda")
    with torch.no_grad():
        ref = model(**xc)[0]
    model.to("cpu")
    return ref, xc
