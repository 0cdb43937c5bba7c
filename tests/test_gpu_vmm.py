"""The vmm route on the GPU over the real CUDA arena (``_native.VmmArena``: cuMemCreate / cuMemMap):
bit-exact at every budget, two components sharing one budget with eviction and restore at the same
addresses, the arena never above its cap, a classic pipeline through ``offload_pipeline(preset=
"vmm_fast")``, and the refusals on the GPU. Marked ``gpu``: skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks.tiny import flux_inputs, tiny_autoencoder_kl

from .helpers import assert_restored, budgets, snapshot
from .test_gpu import _resident_reference, medium_flux

pytestmark = pytest.mark.gpu

CHUNK = 2 << 20


def _arena(n: int) -> ddo_blocks.Arena:
    return ddo_blocks.Arena(n, "cuda", chunk_bytes=CHUNK)


def _slack(n: int, model: torch.nn.Module) -> int:
    from ddo_blocks.units import split_units

    found = split_units(model)[0]
    return n + 2 * CHUNK + 256 * (sum(len(u.params) for u in found) + len(found))


@pytest.mark.parametrize("budget_name", ["all_streamed", "half", "all_resident"])
def test_vmm_on_cuda_equals_resident(budget_name):
    model = medium_flux()
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, _ = _resident_reference(model, x)
    snap = snapshot(model)
    arena = _arena(_slack(budgets(model)[budget_name], model))
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    handle = ddo_blocks.offload(model, route="vmm", arena=arena, device="cuda", component="transformer")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(**x)[0], ref)
    torch.cuda.synchronize()
    fig = arena.report()
    assert fig["peak_device_bytes"] <= arena.budget
    chunk, created, mapped, max_chunks, _, _ = arena.backend.native.stats()
    assert created <= max_chunks and created * chunk + fig["fixed_bytes"] <= arena.budget
    # the driver's view: what the process took beyond the arena is torch's (slots are in the arena)
    used = free0 - torch.cuda.mem_get_info()[0]
    assert used >= mapped * chunk
    handle.remove()
    assert_restored(model, snap)
    arena.close()


def test_two_components_share_one_cuda_budget():
    model = medium_flux()
    vae = tiny_autoencoder_kl(block_out_channels=(64, 128), latent_channels=4)
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, _ = _resident_reference(model, x)
    img = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)).to("cuda")
    vae.to("cuda")
    with torch.no_grad():
        lat = vae.encode(img).latent_dist.mode()
        dec = vae.decode(lat).sample
    vae.to("cpu")
    bf, bv = budgets(model), budgets(vae, "block")
    budget = max(_slack(bf["all_resident"], model), _slack(bv["all_resident"], vae)) + 2 * CHUNK
    assert bf["all_resident"] + bv["all_resident"] > budget
    arena = _arena(budget)
    hf = ddo_blocks.offload(model, route="vmm", arena=arena, device="cuda", component="transformer")
    home = {n: p.data_ptr() for n, p in model.named_parameters()}
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cuda", component="vae")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(**x)[0], ref)
            assert torch.equal(vae.decode(lat).sample, dec)
        model(**x)
    fig = arena.report()
    assert fig["evictions"] > 0 and fig["restored_bytes"] > 0
    assert fig["peak_mapped_bytes"] + fig["fixed_bytes"] <= budget
    resident = {n for u in hf.units if not u.streamed for n, _ in u.module.named_parameters(prefix=u.name)}
    now = dict(model.named_parameters())
    assert resident and all(now[n].data_ptr() == home[n] and now[n].is_cuda for n in resident)
    hv.remove()
    hf.remove()
    arena.close()


def test_offload_pipeline_vmm_fast_is_exact_within_the_budget():
    from diffusers import FluxPipeline

    from ddo_blocks.tiny_pipeline import ensure_tiny_model, load_components

    def image(pipe):
        with torch.no_grad():
            return pipe("a photo of a cat", num_inference_steps=2, height=32, width=32, output_type="pt",
                        generator=torch.Generator().manual_seed(0)).images.cpu()

    root = ensure_tiny_model("flux")
    pipe = FluxPipeline(**load_components(root))
    pipe.to("cuda")
    ref = image(pipe)
    pipe.to("cpu")
    with ddo_blocks.offload_pipeline(pipe, preset="vmm_fast", vram_budget="256MiB", device="cuda") as off:
        assert {h.route for h in off.handles.values()} == {"vmm"}
        assert list(off.handles)[-1] == "transformer"  # the denoiser plans last, with the whole arena
        assert off.policies["transformer"].vram_budget is None
        assert torch.equal(image(pipe), ref)
        assert torch.equal(image(pipe), ref)
        arena = off.report()["transformer"]["arena"]
        assert arena["peak_device_bytes"] <= 256 << 20


def test_a_too_small_arena_leaves_the_module_untouched_on_cuda():
    model = medium_flux()
    snap = snapshot(model)
    with pytest.raises(ddo_blocks.BudgetError):
        ddo_blocks.offload(model, route="vmm", arena=_arena(3 * CHUNK), device="cuda")
    assert_restored(model, snap)
    assert ddo_blocks.get_handle(model) is None
