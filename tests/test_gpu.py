"""The linear route on a real GPU: exactness against the resident forward for every preset and
budget, peak GPU memory within the budget plus the forward's own activations, pinned memory per
preset, OOM during setup. Marked ``gpu``: skipped without CUDA, run by hand on the GPU machine."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

from .helpers import assert_restored, budgets, snapshot

pytestmark = pytest.mark.gpu
PRESETS = ["one_shot_fast", "low_ram_safe", "warm_process", "wsl_compat"]


def medium_flux():
    """About 40 MiB of bf16 weights: big enough that slots and budgets show in memory statistics."""
    return tiny_flux_transformer(dtype=torch.bfloat16, num_layers=4, num_single_layers=8, attention_head_dim=64,
                                 num_attention_heads=4, joint_attention_dim=256, pooled_projection_dim=128,
                                 axes_dims_rope=(16, 24, 24), in_channels=64)


def _resident_reference(model, x):
    model.to("cuda")
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        ref = model(**x)[0]
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - weights
    model.to("cpu")
    torch.cuda.synchronize()
    return ref, activations


@pytest.fixture(autouse=True)
def _clean():
    yield
    ddo_blocks.release_warm_slabs()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def offload_exact_within_budget(model, x, ref, activations, budget, **options):
    """Offloads ``model`` within ``budget`` on the GPU, runs three forwards, checks each equals
    ``ref`` and that peak memory stayed within the budget plus the forward's own activations;
    returns the handle."""
    base_alloc = torch.cuda.memory_allocated()
    handle = ddo_blocks.offload(model, vram_budget=budget, device="cuda", component="transformer", **options)
    assert handle.report()["plan"]["gpu_bytes"] <= budget
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        outs = [model(**x)[0] for _ in range(3)]
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base_alloc
    for out in outs:
        assert torch.equal(out, ref)
    runtime = handle.report()["runtime"]
    assert runtime["host_call_s"] > 0 and 0 < runtime["host_fraction"] < 2.0, runtime  # launches: host ahead
    # weights on the GPU stay inside the budget; activations come on top (plus allocator rounding)
    assert peak <= budget + activations + (2 << 20), (peak, budget, activations)
    return handle


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("budget_name", ["all_streamed", "half", "all_resident"])
def test_cuda_exact_and_within_budget(preset, budget_name):
    model = medium_flux()
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, activations = _resident_reference(model, x)
    snap = snapshot(model)
    budget = budgets(model)[budget_name]
    handle = offload_exact_within_budget(model, x, ref, activations, budget, preset=preset)
    plan = handle.report()["plan"]
    report = handle.report()
    assert report["runtime"]["calls"] == 3 and report["runtime"]["misses"] == 0
    if budget_name == "all_streamed":
        pinned = report["memory"]["pinned_bytes"]
        if preset in ("one_shot_fast", "warm_process"):
            assert pinned >= plan["streamed_bytes"]
        else:
            assert pinned == 0
    handle.remove()
    assert_restored(model, snap)


@pytest.mark.parametrize("codec", ["off", "fixed"])
def test_cuda_module_that_started_on_the_gpu_goes_back(codec):
    model = medium_flux().to("cuda")
    x = flux_inputs(model, device="cuda")
    with torch.no_grad():
        ref = model(**x)[0]
    snap = snapshot(model)
    budget = "min" if codec != "off" else budgets(model)["all_streamed"]
    handle = ddo_blocks.offload(model, vram_budget=budget, device="cuda", codec=codec)
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    handle.remove()
    assert_restored(model, snap)
    assert all(p.is_cuda for p in model.parameters())


def test_cuda_vae_encode_decode_exact():
    from ddo_blocks.tiny import tiny_autoencoder_kl

    vae = tiny_autoencoder_kl()
    img = torch.randn(1, 3, 32, 32, device="cuda")
    vae.to("cuda")
    with torch.no_grad():
        lat = vae.encode(img).latent_dist.mode()
        dec = vae.decode(lat).sample
    vae.to("cpu")
    handle = ddo_blocks.offload(vae, vram_budget=budgets(vae)["all_streamed"], device="cuda", component="vae")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(vae.encode(img).latent_dist.mode(), lat)
            assert torch.equal(vae.decode(lat).sample, dec)
    handle.remove()


def test_out_of_memory_during_setup_restores_the_module():
    model = medium_flux()
    x = flux_inputs(model, device="cuda")
    snap = snapshot(model)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()  # memory cached by earlier tests would hold the weights without an OOM
    used = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction((used + (4 << 20)) / total)  # room for almost nothing
    try:
        # out of memory in the bandwidth probe (first offload of the process) or in the attach
        with pytest.raises(ddo_blocks.OffloadMemoryError, match="restored|as it was"):
            ddo_blocks.offload(model, vram_budget=None, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert_restored(model, snap)
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)["all_streamed"], device="cuda")
    with torch.no_grad():
        model(**x)
    handle.remove()


def test_warm_process_reuse_on_cuda():
    model = medium_flux()
    x = flux_inputs(model, device="cuda")
    ref, _ = _resident_reference(model, x)
    b = budgets(model)["all_streamed"]
    ddo_blocks.offload(model, preset="warm_process", vram_budget=b, device="cuda").remove()
    handle = ddo_blocks.offload(model, preset="warm_process", vram_budget=b, device="cuda")
    assert handle.report()["setup"]["warm_reused"]
    assert handle.report()["memory"]["pinned_bytes"] > 0
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    handle.remove()


@pytest.mark.parametrize("graph", [False, True])
def test_auto_budget_on_a_card_the_model_does_not_fit(monkeypatch, graph):
    from ddo_blocks import autobudget

    # the default 256 MiB margin dwarfs this 40 MiB model; a first budget of a tenth of the free memory
    # (which counts the 128 MiB kept for the driver) keeps it streaming, so that it is re-planned
    monkeypatch.setattr(autobudget, "MARGIN_BYTES", 64 << 20)
    monkeypatch.setattr(autobudget, "START_FRACTION", 0.1)
    model = medium_flux()
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, activations = _resident_reference(model, x)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    from ddo_blocks.streaming import bandwidth

    bandwidth.link_bytes_per_s(torch.device("cuda", torch.cuda.current_device()))  # its 256 MiB probe, before the card fills
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    # a card with room for about 60 % of the weights, and 128 MiB the driver needs for streams and events
    keep = int(0.6 * weights) + activations + (128 << 20)
    blocker = torch.empty(free - keep, dtype=torch.uint8, device="cuda")
    try:
        handle = ddo_blocks.offload(model, vram_budget="auto", device="cuda", graph=graph)
        first = handle.vram_budget
        assert handle.report()["plan"]["streamed_units"] > 0, handle.report()["plan"]
        with torch.no_grad():
            outs = [model(**x)[0] for _ in range(9 if graph else 4)]
        assert all(torch.equal(o, ref) for o in outs)
        if graph:  # captured beside the auto budget's plan, on the card as full as it is
            g = handle.report()["graph"]
            assert g["capture_failures"] == 0 and g["replays"] > 0, g
        auto = handle.report()["auto_budget"]
        assert auto["first_budget_bytes"] == first and auto["activation_bytes"] > 0
        assert handle.vram_budget > first and auto["replanned_budget_bytes"] == handle.vram_budget, auto
        assert handle.report()["plan"]["gpu_bytes"] <= handle.vram_budget < keep
        handle.remove()
    finally:
        del blocker
