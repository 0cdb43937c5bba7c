"""Never silently wrong: each way the engine could give a wrong tensor (or the wrong error) without
saying so, on the CPU engine, which runs the same slots, hooks and copies as the GPU one."""

from __future__ import annotations

import torch
from torch import nn

import ddo_blocks

from .helpers import assert_restored, snapshot


class _Block(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # a weight stored transposed (as after nn.Parameter(w.t())) and a bias expanded from one row
        self.weight = nn.Parameter(torch.randn(48, 48, generator=g).t())
        self.bias = nn.Parameter(torch.randn(1, 48, generator=g).expand(5, 48))
        self.proj = nn.Linear(48, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.addmm(self.bias, x, self.weight).tanh())


class _Strided(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block(i) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_non_contiguous_and_expanded_parameters_stay_exact_and_keep_their_strides():
    model = _Strided().eval()
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    strides = {n: p.stride() for n, p in model.named_parameters()}
    snap = snapshot(model)
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    assert handle.plan["slots"] >= 2 and not all(handle.plan["resident"])
    with torch.no_grad():
        outs = [model(x) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    handle.remove()
    assert_restored(model, snap)
    assert {n: p.stride() for n, p in model.named_parameters()} == strides
    assert not [n for n, p in model.named_parameters() if p.data_ptr() % 64]
    with torch.no_grad():
        assert torch.equal(model(x), ref)
