"""Never silently wrong: each way the engine could give a wrong tensor (or the wrong error) without
saying so, on the CPU engine, which runs the same slots, hooks and copies as the GPU one."""

from __future__ import annotations

import pytest
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
    assert handle.plan.slots >= 2 and not all(handle.plan.resident)
    with torch.no_grad():
        outs = [model(x) for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    handle.remove()
    assert_restored(model, snap)
    assert {n: p.stride() for n, p in model.named_parameters()} == strides
    assert not [n for n, p in model.named_parameters() if p.data_ptr() % 64]
    with torch.no_grad():
        assert torch.equal(model(x), ref)


# -- autograd -------------------------------------------------------------------------------------
def _flux_streamed(flux):
    handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux, units="block"), device="cpu",
                                units="block")
    assert not all(handle.plan.resident)
    return handle


def test_backward_through_frozen_streamed_weights_is_refused(flux):
    from ddo_blocks.tiny import flux_inputs

    flux.requires_grad_(False)
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = _flux_streamed(flux)
    latents = x["hidden_states"].clone().requires_grad_(True)  # guidance on the latents
    with pytest.raises(ddo_blocks.OffloadStateError, match="requires grad.*torch.no_grad"):
        flux(**{**x, "hidden_states": latents})
    flux.x_embedder.requires_grad_(True)  # a trainable resident layer before the streamed blocks (LoRA-like)
    with pytest.raises(ddo_blocks.OffloadStateError, match="trainable layer before it"):
        flux(**x)
    flux.x_embedder.requires_grad_(False)
    # nothing was left half-done: the next calls are exact
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    assert torch.equal(flux(**x)[0].detach(), ref)  # grad on, nothing requires it: allowed and exact
    handle.remove()


# -- threads --------------------------------------------------------------------------------------
def _hammer(model, inputs, calls: int, threads: int):
    import threading

    outs: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(calls):
                with torch.no_grad():
                    outs.append(model(**inputs)[0])
        except BaseException as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in pool), "a thread is stuck"
    return outs, errors


def test_two_threads_on_one_offloaded_module_take_turns(flux):
    from ddo_blocks.tiny import flux_inputs

    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = ddo_blocks.offload(flux, preset="one_shot_fast", vram_budget=ddo_blocks.minimum_budget(flux),
                                device="cpu")
    outs, errors = _hammer(flux, x, calls=15, threads=2)
    assert not errors, errors
    assert len(outs) == 30 and sum(not torch.equal(o, ref) for o in outs) == 0
    handle.remove()


def test_two_threads_on_the_nvme_route_take_turns(flux_checkpoints):
    from diffusers import FluxTransformer2DModel

    root, model, x, ref = flux_checkpoints
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root / "single", route="nvme", ram_budget=0,
                                        vram_budget=ddo_blocks.minimum_budget(model, units="block"), device="cpu",
                                        progress=False, units="block")
    outs, errors = _hammer(handle.module, x, calls=15, threads=2)
    assert not errors, errors
    assert len(outs) == 30 and sum(not torch.equal(o, ref) for o in outs) == 0
    handle.remove()


# -- conversions ----------------------------------------------------------------------------------
def test_conversions_that_change_the_weights_are_refused_and_no_ops_pass(flux):
    from ddo_blocks.tiny import flux_inputs

    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = _flux_streamed(flux)
    for convert in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                    lambda m: m.transformer_blocks[0].to(torch.float16), lambda m: m.to("meta")):
        with pytest.raises(ddo_blocks.OffloadStateError, match="remove\\(\\) on the handle, convert the module"):
            convert(flux)
    assert flux.to("cpu") is flux and flux.float() is flux and flux.to(torch.float32) is flux  # change nothing
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    handle.remove()
    assert {p.dtype for p in flux.parameters()} == {torch.float32}
    assert flux.to(torch.bfloat16) is flux and {p.dtype for p in flux.parameters()} == {torch.bfloat16}


# -- stacked offloads -----------------------------------------------------------------------------
def test_offloading_inside_or_around_an_offload_is_refused(flux):
    handle = _flux_streamed(flux)
    with pytest.raises(ddo_blocks.OffloadStateError, match="part of a module that is already offloaded"):
        ddo_blocks.offload(flux.transformer_blocks, device="cpu")
    with pytest.raises(ddo_blocks.OffloadStateError, match="diffusers group offloading on top"):
        flux.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    handle.remove()
    child = ddo_blocks.offload(flux.single_transformer_blocks[0], device="cpu", route="resident")
    with pytest.raises(ddo_blocks.OffloadStateError, match="holds single_transformer_blocks.0"):
        ddo_blocks.offload(flux, device="cpu")
    child.remove()
    ddo_blocks.offload(flux, device="cpu").remove()  # and nothing is left behind


def _group_offload(module):
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(module, onload_device=torch.device("cpu"), offload_type="leaf_level")


def _accelerate_offload(module):
    from accelerate import cpu_offload

    cpu_offload(module, execution_device=torch.device("cpu"))


@pytest.mark.parametrize("apply", [_group_offload, _accelerate_offload], ids=["apply_group_offloading", "cpu_offload"])
def test_offloading_hooks_on_top_are_refused_at_the_next_call(flux, apply):
    from ddo_blocks.tiny import flux_inputs

    x = flux_inputs(flux)
    _flux_streamed(flux)
    apply(flux)
    with pytest.raises(ddo_blocks.OffloadStateError, match="was applied on top"), torch.no_grad():
        flux(**x)


def test_a_module_on_the_meta_device_is_a_config_error():
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    from ddo_blocks.tiny import TINY_FLUX_TRANSFORMER

    with init_empty_weights():
        model = FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER)
    with pytest.raises(ddo_blocks.ConfigError, match="meta device.*never loaded.*from_pretrained"):
        ddo_blocks.offload(model, vram_budget="1MiB", device="cpu")
    assert ddo_blocks.get_handle(model) is None


# -- alignment ------------------------------------------------------------------------------------
def test_every_view_the_engine_binds_is_aligned_as_pytorch_allocates(flux, flux_checkpoints):
    """CPU kernels may take another path for a tensor at an address PyTorch's allocator would not
    give (64 bytes): every slab and slot view a parameter is pointed at sits on at least that, so
    torch.equal with the resident run holds by construction, on any CPU."""
    from diffusers import FluxTransformer2DModel

    from ddo_blocks.streaming.slabs import ALIGN

    assert ALIGN % 64 == 0
    root, model, _, _ = flux_checkpoints
    handles = [
        ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu"),
        ddo_blocks.from_pretrained(FluxTransformer2DModel, root / "single", route="nvme", ram_budget="64KiB",
                                   vram_budget=ddo_blocks.minimum_budget(model, units="block"), device="cpu",
                                   progress=False, units="block"),
    ]
    for handle in handles:
        engine = handle.engine  # white-box by nature: the views are what the engine binds
        views = engine.slots.all_views() + engine.store.all_views()
        assert views and not [v.data_ptr() for v in views if v.data_ptr() % 64]
        handle.remove()
        assert not [n for n, p in handle.module.named_parameters() if p.data_ptr() % 64]


def test_a_unit_called_on_its_own_is_checked_like_a_call():
    """Blocks called directly (outside the component's forward) still refuse backward through
    streamed weights and take the component's lock."""

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model = Blocks()  # parameters require grad, as a freshly built module's do
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model.blocks[0](x)
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model, units="block"), device="cpu",
                                units="block")
    with pytest.raises(ddo_blocks.OffloadStateError, match="the unit's own parameters"):
        model.blocks[0](x)
    assert handle.engine.scheduler.lock.acquire(blocking=False)  # the refused call gave the lock back
    handle.engine.scheduler.lock.release()
    with torch.no_grad():
        assert torch.equal(model.blocks[0](x), ref)
    handle.remove()
