"""offload_pipeline(): one line for a classic Diffusers pipeline, exact, within one budget."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks import BudgetError, ConfigError, OffloadStateError

from .helpers import assert_restored, snapshot


@pytest.fixture(scope="module")
def flux_dir():
    from ddo_blocks.tiny_pipeline import ensure_tiny_model

    return ensure_tiny_model("flux")


@pytest.fixture
def pipe(flux_dir):
    from diffusers import FluxPipeline

    from ddo_blocks.tiny_pipeline import load_components

    return FluxPipeline(**load_components(flux_dir))


def _image(pipe):
    with torch.no_grad():
        return pipe("a photo of a cat", num_inference_steps=2, height=32, width=32, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images


def _modules(pipe):
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def test_classic_pipeline_exact_within_one_budget(pipe):
    ref = _image(pipe)
    snaps = {n: snapshot(m) for n, m in _modules(pipe).items()}
    minimum = ddo_blocks.minimum_budget(pipe.transformer)
    weights = sum(sum(p.numel() * p.element_size() for p in m.parameters()) for m in _modules(pipe).values())
    budget = int(weights * 0.8)
    off = ddo_blocks.offload_pipeline(pipe, vram_budget=budget, device="cpu")
    assert set(off.handles) == set(_modules(pipe))
    assert off.handles["transformer"].route == "linear"
    assert off.policies["transformer"].vram_budget >= minimum
    assert off.gpu_bytes <= budget
    assert torch.equal(_image(pipe), ref)
    assert torch.equal(_image(pipe), ref)
    reports = off.report()
    assert set(reports) == set(off.handles) and reports["transformer"]["runtime"]["calls"] == 4
    hook = pipe.transformer._hf_hook
    assert getattr(hook, "_ddo_owned", False) and hook.execution_device == torch.device("cpu")
    assert pipe._execution_device == torch.device("cpu")
    off.remove()
    for name, module in _modules(pipe).items():
        assert_restored(module, snaps[name])
        assert not hasattr(module, "_hf_hook"), name
    assert torch.equal(_image(pipe), ref)


def test_per_component_policies_and_their_errors(pipe):
    ref = _image(pipe)
    with ddo_blocks.offload_pipeline(pipe, device="cpu", text_encoder_2="diffusers", vae="resident") as off:
        assert off.handles["text_encoder_2"].route == "diffusers" and off.handles["vae"].route == "resident"
        assert torch.equal(_image(pipe), ref)
    with pytest.raises(ConfigError, match="has no component\\(s\\) with weights named unet"):
        ddo_blocks.offload_pipeline(pipe, device="cpu", unet="linear")
    with pytest.raises(ConfigError, match="takes a pipeline, got the module"):
        ddo_blocks.offload_pipeline(pipe.transformer, device="cpu")
    with pytest.raises(ConfigError, match="takes one component .* pipe.transformer"):
        ddo_blocks.offload(pipe, device="cpu")
    with pytest.raises(ConfigError, match="minimum_budget\\(\\) takes one component"):
        ddo_blocks.minimum_budget(pipe)
    with pytest.raises(BudgetError, match="leaves nothing for the transformer .* after .* below the .* it needs"):
        ddo_blocks.offload_pipeline(pipe, vram_budget=ddo_blocks.minimum_budget(pipe.transformer), device="cpu",
                                    vae="resident", text_encoder="resident")
    assert all(ddo_blocks.get_handle(m) is None for m in _modules(pipe).values())  # nothing placed


def test_refuses_a_pipeline_offloaded_by_diffusers(pipe):
    pipe.transformer.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    with pytest.raises(OffloadStateError, match="component 'transformer' .* diffusers group offloading"):
        ddo_blocks.offload_pipeline(pipe, device="cpu")
    assert all(ddo_blocks.get_handle(m) is None for m in _modules(pipe).values())


def test_a_given_denoiser_policy_stays_inside_the_pipeline_budget(pipe):
    weights = sum(sum(p.numel() * p.element_size() for p in m.parameters()) for m in _modules(pipe).values())
    budget = int(weights * 0.5)
    with ddo_blocks.offload_pipeline(pipe, vram_budget=budget, device="cpu", transformer="linear") as off:
        assert off.gpu_bytes <= budget  # its route given, its budget what the others leave
    with pytest.raises(BudgetError, match="leaves .* for the transformer \\(linear, budget"):
        ddo_blocks.offload_pipeline(pipe, vram_budget=budget, device="cpu", transformer={"vram_budget": budget})
    with pytest.raises(BudgetError, match="for the transformer \\(resident\\)"):
        ddo_blocks.offload_pipeline(pipe, vram_budget=budget, device="cpu", transformer="resident")


def test_a_component_another_offloader_keeps_can_be_left_to_it(pipe):
    pipe.transformer.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    off = ddo_blocks.offload_pipeline(pipe, device="cpu", transformer="off")
    assert off.handles["transformer"].route == "off"
    off.remove()


def test_a_component_can_name_its_own_device(pipe):
    ref = _image(pipe)
    with ddo_blocks.offload_pipeline(pipe, device="cpu", vram_budget="1GiB",
                                     text_encoder_2={"device": "cpu"}) as off:
        assert off.policies["text_encoder_2"].route == "resident"
        assert torch.equal(_image(pipe), ref)
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="cuda:1"):
        ddo_blocks.offload_pipeline(pipe, device="cpu", text_encoder_2={"device": "cuda:1"})
    assert torch.equal(_image(pipe), ref)  # refused before anything moved


def test_the_device_hook_moves_a_call_to_the_component_s_device_and_back():
    from ddo_blocks.execution_device import ExecutionDeviceHook

    hook = ExecutionDeviceHook(torch.device("cpu"), torch.device("meta"))
    lin = torch.nn.Linear(2, 2)
    args, kwargs = hook.pre_forward(lin, torch.ones(2), scale=torch.ones(1))
    assert args[0].device.type == "meta" and kwargs["scale"].device.type == "meta"
    assert hook._came_from == [torch.device("cpu")]
    plain = ExecutionDeviceHook(torch.device("cpu"), torch.device("cpu"))  # one device: nothing moves
    x = torch.ones(2)
    assert plain.pre_forward(lin, x)[0][0] is x and plain.post_forward(lin, x) is x


@pytest.mark.gpu
def test_a_text_encoder_on_a_second_gpu_gives_the_one_gpu_image(flux_dir):
    from diffusers import FluxPipeline

    from ddo_blocks.tiny_pipeline import load_components

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the nvidia-h200-x2 machine)")
    pipe = FluxPipeline(**load_components(flux_dir))
    with ddo_blocks.offload_pipeline(pipe, device="cuda:0", vram_budget="1GiB"):
        ref = _image(pipe).cpu()
    pipe = FluxPipeline(**load_components(flux_dir))
    with ddo_blocks.offload_pipeline(pipe, device="cuda:0", vram_budget="1GiB",
                                     text_encoder_2={"device": "cuda:1"}) as off:
        assert off.handles["text_encoder_2"].device == torch.device("cuda", 1)
        assert pipe._execution_device == torch.device("cuda", 0)
        assert torch.equal(_image(pipe).cpu(), ref)


@pytest.mark.parametrize("method,kwargs", [
    ("enable_group_offload", {"onload_device": torch.device("cpu"), "offload_type": "block_level",
                              "num_blocks_per_group": 1}),
    ("enable_model_cpu_offload", {}),
    ("enable_sequential_cpu_offload", {}),
])
def test_diffusers_offloading_on_top_of_the_pipeline_is_refused_before_it_installs_anything(pipe, method, kwargs):
    """Every component, those kept resident included, is left as it was: the refusal comes from the
    pipeline, before diffusers touches any of them."""
    ref = _image(pipe)
    weights = sum(sum(p.numel() * p.element_size() for p in m.parameters()) for m in _modules(pipe).values())
    off = ddo_blocks.offload_pipeline(pipe, vram_budget=int(weights * 0.8), device="cpu")
    with pytest.raises(OffloadStateError, match=f"pipe.{method}\\(\\) would move the same weights"):
        getattr(pipe, method)(**kwargs)
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    for name, module in _modules(pipe).items():
        assert not _is_group_offload_enabled(module), name
        hook = module.__dict__.get("_hf_hook")
        assert hook is None or getattr(hook, "_ddo_owned", False), name
    assert torch.equal(_image(pipe), ref)
    off.remove()
    assert method not in pipe.__dict__
