"""DDO blocks in a Modular pipeline: the tiny Flux pipeline with mixed routes gives exactly the image of
the same pipeline without offloading; each stage reports; bad inputs fail before any weight moves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers.modular_pipelines import FluxAutoBlocks

import ddo_blocks
from ddo_blocks import BudgetError, ConfigError, OffloadStateError
from ddo_blocks.blocks import (
    REPORTS_KEY,
    DecodeBlock,
    DenoiseBlock,
    OffloadBlock,
    OffloadPolicy,
    TextEncoderBlock,
    default_policy,
    remove_offload,
)
from ddo_blocks.blocks.runner import minimum_budget
from ddo_blocks.tiny_pipeline import CALL_DEFAULTS, ensure_tiny_model, load_components

from .helpers import assert_restored, snapshot

CACHE = Path(__file__).resolve().parents[1] / ".ddo_cache"
MODULES = ("text_encoder", "text_encoder_2", "transformer", "vae")


@pytest.fixture(scope="session")
def flux_dir() -> Path:
    return ensure_tiny_model("flux", CACHE)


@pytest.fixture
def components(flux_dir):
    return load_components(flux_dir)


def _run(blocks, components, **kw):
    pipe = blocks.init_pipeline()
    pipe.update_components(**components)
    state = pipe(prompt="a cat on a tree", generator=torch.Generator().manual_seed(0), output_type="pt",
                 **{**CALL_DEFAULTS["flux"], **kw})
    return pipe, state


@pytest.fixture(scope="session")
def reference(flux_dir):
    _, state = _run(FluxAutoBlocks(), load_components(flux_dir))
    return state.get("images")


def _mixed(components, device="cpu"):
    return ddo_blocks.wrap(
        FluxAutoBlocks(),
        device=device,
        text_encoder={"route": "diffusers", "offload_type": "leaf_level"},
        denoise={"route": "linear", "preset": "one_shot_fast",
                 "vram_budget": minimum_budget(components["transformer"])},
        decode="resident",
    )


def test_mixed_routes_give_the_same_image(components, reference):
    snaps = {n: snapshot(components[n]) for n in MODULES}
    pipe, state = _run(_mixed(components), components)
    assert torch.equal(state.get("images"), reference)

    reports = state.get(REPORTS_KEY)
    assert set(reports) == {"text_encoder", "denoise", "decode"}  # vae_encoder did not run: no image
    assert set(reports["text_encoder"]) == {"text_encoder", "text_encoder_2"}
    te = reports["text_encoder"]["text_encoder_2"]
    assert (te["route"], te["preset"], te["plan"]["offload_type"]) == (
        "diffusers", "diffusers_leaf_offload_compat", "leaf_level")
    tr = reports["denoise"]["transformer"]
    assert tr["route"] == "linear" and tr["preset"] == "one_shot_fast"
    # the budget forces streaming: units cross the link on every call, and the plan fits the budget
    assert tr["plan"]["streamed_units"] > 1 and tr["plan"]["streamed_bytes"] > 0
    assert tr["runtime"]["h2d_call_bytes"] > 0
    assert tr["plan"]["gpu_bytes"] <= tr["plan"]["vram_budget"]
    assert tr["runtime"]["calls"] == CALL_DEFAULTS["flux"]["num_inference_steps"]
    assert len(tr["timeline"]) == tr["runtime"]["calls"]
    assert reports["decode"]["vae"]["route"] == "resident"
    assert all(isinstance(r, ddo_blocks.Report) for per in reports.values() for r in per.values())

    # a second run reuses the handles and gives the same image again
    handle = ddo_blocks.get_handle(components["transformer"])
    state2 = pipe(prompt="a cat on a tree", generator=torch.Generator().manual_seed(0), output_type="pt",
                  **CALL_DEFAULTS["flux"])
    assert torch.equal(state2.get("images"), reference)
    assert ddo_blocks.get_handle(components["transformer"]) is handle
    assert state2.get(REPORTS_KEY)["denoise"]["transformer"]["runtime"]["calls"] == 2 * tr["runtime"]["calls"]

    assert remove_offload(pipe) == 4
    for n in MODULES:
        assert ddo_blocks.get_handle(components[n]) is None
        assert not hasattr(components[n], "_hf_hook")
        assert_restored(components[n], snaps[n])


def test_execution_device_resolves_through_the_block_hook(components):
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", preset="one_shot_fast",
                             text_encoder="linear", decode="linear")
    pipe, _ = _run(blocks, components)
    hook = components["text_encoder"]._hf_hook
    assert isinstance(hook, ddo_blocks.blocks.ExecutionDeviceHook)
    assert pipe._execution_device == torch.device("cpu") == hook.execution_device
    remove_offload(pipe)


def test_a_stage_can_name_its_own_device(components, reference, monkeypatch):
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder={"device": "cpu", "route": "resident"},
                             denoise={"device": "cpu"})
    assert blocks.sub_blocks["text_encoder"].device == torch.device("cpu")
    assert blocks.sub_blocks["text_encoder"].component_policies["text_encoder"].route == "resident"
    pipe, state = _run(blocks, components)
    assert torch.equal(state.get("images"), reference)
    stage = state.get(REPORTS_KEY)["text_encoder"]["text_encoder"]["stage"]
    assert stage["device"] == "cpu" and stage["moved_in"] == 0  # one device: nothing crosses
    remove_offload(pipe)
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="cuda:1"):
        ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder={"device": "cuda:1"})
    # a component two stages share lives on one device (checked before any device is opened)
    import importlib

    monkeypatch.setattr(importlib.import_module("ddo_blocks.blocks.wrap"), "resolve_device", torch.device)
    with pytest.raises(ConfigError, match="component 'vae' is used by stages .* on different devices"):
        ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", decode={"device": "cuda:1"})


def test_the_state_moves_only_tensors_of_another_gpu():
    from diffusers.modular_pipelines import PipelineState

    from ddo_blocks.blocks.block import move_state

    state = PipelineState()
    state.set("latents", torch.ones(2))
    state.set("pair", (torch.zeros(1), 3))
    assert move_state(state, torch.device("cpu")) == 0
    assert move_state(state, torch.device("cuda", 0)) == 0  # CPU tensors stay where the pipeline put them
    assert torch.equal(state.get("latents"), torch.ones(2))


def test_release_takes_the_text_encoders_off_the_device(components, reference):
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="resident", denoise="resident",
                             decode="resident")
    te = blocks.sub_blocks["text_encoder"]
    assert all(p.release for p in te.component_policies.values())  # the stage's default is kept
    assert not blocks.sub_blocks["denoise"].component_policies["transformer"].release
    pipe, state = _run(blocks, components)
    assert torch.equal(state.get("images"), reference)
    assert ddo_blocks.get_handle(components["text_encoder"]) is None  # released after its stage
    assert ddo_blocks.get_handle(components["transformer"]) is not None  # kept for the next run
    assert state.get(REPORTS_KEY)["text_encoder"]["text_encoder"]["active"] is True  # reported before release
    assert hasattr(components["text_encoder"], "_hf_hook")  # still resolves the execution device
    remove_offload(pipe)


def test_stages_left_out_keep_the_preset_default():
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", denoise="resident")
    te = blocks.sub_blocks["text_encoder"].component_policies
    assert te["text_encoder"] == te["text_encoder_2"] == default_policy("text_encoder")
    assert te["text_encoder"].route == "diffusers" and te["text_encoder"].preset == "diffusers_leaf_offload_compat"
    assert blocks.sub_blocks["decode"].component_policies["vae"] == default_policy("decode")
    assert blocks.sub_blocks["denoise"].component_policies["transformer"].route == "resident"
    assert isinstance(blocks.sub_blocks["text_encoder"], TextEncoderBlock)
    assert isinstance(blocks.sub_blocks["denoise"], DenoiseBlock)
    assert isinstance(blocks.sub_blocks["decode"], DecodeBlock)
    assert blocks.sub_blocks["vae_encoder"].component_policies["vae"] == default_policy("decode")
    # the wrapper is a leaf: the inner stage is not in sub_blocks, so workflow pruning keeps it
    assert len(blocks.sub_blocks["denoise"].sub_blocks) == 0
    assert "denoise" in blocks.get_workflow("text2image").sub_blocks
    off = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", preset="off")
    assert {p.route for b in off.sub_blocks.values() for p in b.component_policies.values()} == {"off"}


def test_policy_forms_are_equivalent():
    as_map = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu",
                             denoise={"route": "linear", "preset": "low_ram_safe", "vram_budget": "1MiB"})
    as_obj = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu",
                             denoise=OffloadPolicy("linear", "low_ram_safe", vram_budget=2**20))
    per_comp = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu",
                               denoise={"transformer": {"route": "linear", "preset": "low_ram_safe",
                                                        "vram_budget": 1048576}})
    got = [b.sub_blocks["denoise"].component_policies["transformer"] for b in (as_map, as_obj, per_comp)]
    assert got[0] == got[1] == got[2]
    with pytest.raises(Exception):
        got[0].route = "off"  # frozen
    with pytest.raises(TypeError, match="read-only"):
        OffloadPolicy("diffusers", options={"offload_type": "leaf_level"}).options["use_stream"] = True


# ---------------------------------------------------------------------------------------------------
# bad inputs: a clear error, before any weight moves
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"denoiser": "linear"}, "has no stage.*'denoiser'.*its stages are text_encoder, vae_encoder, denoise, decode"),
        ({"text_encoder": {"text_encoder_3": "resident"}},
         "text_encoder_3.*neither a component of this stage \\(text_encoder, text_encoder_2\\)"),
        ({"text_encoder": {"text_encoder": "resident", "text_encoder_3": "off"}},
         "no component\\(s\\) text_encoder_3; its components with weights are text_encoder, text_encoder_2"),
        ({"denoise": "fast"}, "unknown route 'fast'; valid routes: linear, resident, off, diffusers"),
        ({"denoise": {"route": "linear", "preset": "turbo"}}, "unknown preset 'turbo' for route 'linear'"),
        ({"denoise": {"route": "linear", "offload_type": "leaf_level"}},
         "offload_type is neither a policy key .* nor an option of route 'linear'"),
        ({"denoise": {"route": "diffusers", "use_stream": True}}, "use_stream=True needs a CUDA device"),
        ({"denoise": {"route": "diffusers", "vram_budget": "1GiB"}}, "takes no vram_budget.*route='linear'"),
        ({"denoise": {"vram_budget": "six gigs"}}, "vram_budget='six gigs' is not a size"),
        ({"vae_encoder": "linear", "decode": "resident"},
         "component 'vae' is used by stages 'decode' \\(resident\\) and 'vae_encoder' \\(linear\\)"),
        ({"preset": "vmm_fast"}, "share one VRAM budget: pass wrap\\(..., vram_budget="),
        ({"vram_budget": "8GiB"}, "no stage is on it: pass preset='vmm_fast'"),
    ],
)
def test_wrap_errors_name_what_would_work(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", **kwargs)


def test_wrap_rejects_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="use device=.cpu."):
        ddo_blocks.wrap(FluxAutoBlocks(), device="cuda")


def test_a_component_without_weights_cannot_be_placed():
    stage = FluxAutoBlocks().sub_blocks["text_encoder"]
    with pytest.raises(ConfigError, match="no component\\(s\\) with weights named tokenizer; its components "
                                          "with weights are text_encoder, text_encoder_2"):
        OffloadBlock(stage, stage="text_encoder", components=["tokenizer"], device="cpu")


def _run_expecting(blocks, components, exc, match):
    snaps = {n: snapshot(components[n]) for n in MODULES}
    with pytest.raises(exc, match=match):
        _run(blocks, components)
    return snaps


def test_budget_below_the_largest_unit_is_a_budget_error(components):
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="off", decode="off",
                             denoise={"route": "linear", "vram_budget": 1024})
    snaps = _run_expecting(blocks, components, BudgetError,
                           "stage 'denoise', component 'transformer': vram_budget=1.00 KiB is below the minimum "
                           ".* largest unit")
    assert ddo_blocks.get_handle(components["transformer"]) is None
    assert_restored(components["transformer"], snaps["transformer"])


def test_lossless_is_checked_against_the_uncompressed_minimum(components, monkeypatch):
    # codec="lossless" streams uncompressed where its codes' landing buffers do not fit, so a stage's
    # budget at the plain minimum passes the check (landing buffers as a GPU's: the tiny model is fp32)
    from ddo_blocks.streaming import coded

    monkeypatch.setattr(coded, "reserve_bytes", lambda m, c, d: 0 if c == "off" or d.type != "cuda" else 1 << 20)
    plain = ddo_blocks.minimum_budget(components["transformer"])
    assert ddo_blocks.minimum_budget(components["transformer"], codec="lossless") > plain
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="off", decode="off",
                             denoise={"route": "linear", "vram_budget": plain, "codec": "lossless"})
    pipe = blocks.init_pipeline()
    pipe.update_components(**components)
    ddo_blocks.blocks.validate(pipe)


def test_resident_over_budget_says_use_linear(components):
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="off",
                             denoise={"route": "resident", "vram_budget": "64KiB"})
    # the same class and words as offload(route="resident") over budget: one check, in the route
    snaps = _run_expecting(blocks, components, ddo_blocks.BudgetError,
                           "stage 'denoise', component 'transformer': route='resident' puts all .* more than "
                           "vram_budget=64.00 KiB; raise the budget or use route='linear'")
    assert_restored(components["transformer"], snaps["transformer"])


def test_route_the_component_cannot_use(components, monkeypatch):
    monkeypatch.setattr(type(components["vae"]), "_supports_group_offloading", False)
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="off", denoise="off",
                             decode={"route": "diffusers"})
    snaps = _run_expecting(blocks, components, ConfigError,
                           "stage '(vae_encoder|decode)', component 'vae': vae \\(AutoencoderKL\\) does not support "
                           "diffusers group "
                           "offloading.*"
                           "use route='linear' or route='resident'")
    assert_restored(components["vae"], snaps["vae"])
    assert ddo_blocks.get_handle(components["vae"]) is None


def test_conflicting_offloading_already_applied(components):
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    tr = components["transformer"]
    tr.enable_group_offload(onload_device="cpu", offload_type="leaf_level")
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="off", denoise="linear")
    _run_expecting(blocks, components, OffloadStateError,
                   "component 'transformer' .* already has diffusers group offloading.*route='off'")
    assert _is_group_offload_enabled(tr)  # left as the caller made it
    assert ddo_blocks.get_handle(tr) is None


def test_a_component_offloaded_by_hand_is_a_conflict(components):
    te = components["text_encoder"]
    handle = ddo_blocks.offload(te, route="resident", device="cpu")
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="linear")
    snap2 = snapshot(components["text_encoder_2"])
    with pytest.raises(OffloadStateError, match="'text_encoder' .* already offloaded by ddo_blocks.offload"):
        _run(blocks, components)
    assert ddo_blocks.get_handle(components["text_encoder_2"]) is None  # nothing of this stage was placed
    assert_restored(components["text_encoder_2"], snap2)
    handle.remove()


def test_failure_in_a_stage_rolls_back_what_it_placed(components):
    stage = FluxAutoBlocks().sub_blocks["text_encoder"]
    block = OffloadBlock(stage, stage="text_encoder", device="cpu",
                         policy={"text_encoder": "resident", "text_encoder_2": {"route": "linear", "vram_budget": 1}})
    snap = snapshot(components["text_encoder"])
    pipe = block.init_pipeline()
    pipe.update_components(**{k: components[k] for k in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")})
    with pytest.raises(BudgetError):
        pipe(prompt="a cat", max_sequence_length=16)
    assert ddo_blocks.get_handle(components["text_encoder"]) is None
    assert not hasattr(components["text_encoder"], "_hf_hook")
    assert_restored(components["text_encoder"], snap)


# ---------------------------------------------------------------------------------------------------
# GPU (run by hand on the GPU machine)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_mixed_routes_exact_on_cuda_and_each_stage_within_budget(flux_dir):
    comps = load_components(flux_dir)
    plain = FluxAutoBlocks().init_pipeline()
    plain.update_components(**comps)
    plain.to("cuda")
    gen = torch.Generator("cpu").manual_seed(0)
    ref = plain(prompt="a cat on a tree", generator=gen, output_type="pt", **CALL_DEFAULTS["flux"]).get("images")
    # activations of each stage, measured on the resident pipeline (weights excluded)
    plain.to("cpu")
    torch.cuda.synchronize()
    comps = load_components(flux_dir)
    budget = minimum_budget(comps["transformer"])
    blocks = ddo_blocks.wrap(
        FluxAutoBlocks(), device="cuda",
        text_encoder={"route": "diffusers", "offload_type": "leaf_level"},
        denoise={"route": "linear", "preset": "one_shot_fast", "vram_budget": budget},
        decode="resident",
    )
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    pipe, state = _run(blocks, comps)
    assert torch.equal(state.get("images").cpu(), ref.cpu())
    reports = state.get(REPORTS_KEY)
    tr = reports["denoise"]["transformer"]
    vae_bytes = sum(p.numel() * p.element_size() for p in comps["vae"].parameters())
    # each stage's peak: its budget (the resident VAE stays placed: it counts from decode on) plus
    # activations, which for the tiny model are far below 8 MiB
    slack = 8 * 2**20
    assert tr["stage"]["gpu_peak_allocated"] - base <= budget + slack
    assert tr["plan"]["gpu_bytes"] <= budget
    dec = reports["decode"]["vae"]
    assert dec["stage"]["gpu_peak_allocated"] - base <= budget + vae_bytes + slack
    remove_offload(pipe)


def test_linear_route_option_units_passes_through():
    from ddo_blocks.blocks.policy import OffloadPolicy

    policy = OffloadPolicy(route="linear", options={"units": "child"})
    assert policy.offload_kwargs()["units"] == "child"
    with pytest.raises(ddo_blocks.ConfigError, match="units"):
        OffloadPolicy(route="linear", options={"unit": "child"})


def test_every_stage_is_checked_before_the_first_one_runs(components):
    """A budget below the denoiser's minimum fails before the text encoders run, with one clean error
    from validate() (the staged scripts call it before the pipeline) and from the pipeline itself."""
    calls = {"n": 0}
    hook = components["text_encoder"].register_forward_pre_hook(lambda m, a: calls.__setitem__("n", calls["n"] + 1))
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="resident", decode="off",
                             denoise={"route": "linear", "vram_budget": "10KiB"})
    pipe = blocks.init_pipeline()
    pipe.update_components(**components)
    match = "stage 'denoise', component 'transformer': vram_budget=10.00 KiB is below the minimum"
    with pytest.raises(BudgetError, match=match):
        ddo_blocks.blocks.validate(pipe)
    with pytest.raises(BudgetError, match=match):
        pipe(prompt="a cat", generator=torch.Generator().manual_seed(0), output_type="pt", **CALL_DEFAULTS["flux"])
    hook.remove()
    assert calls["n"] == 0, "a text encoder ran before the error"
    assert all(ddo_blocks.get_handle(m) is None for m in components.values() if isinstance(m, torch.nn.Module))


def test_a_component_report_has_the_same_fields_in_a_block_and_through_offload(components):
    """Each engine contributes its own sections: a block adds only its stage section and stage_s."""
    vae = components["vae"]
    plain = ddo_blocks.offload(vae, route="diffusers", preset="diffusers_leaf_offload_compat", device="cpu",
                               component="vae")
    fields = {k: set(v) if isinstance(v, dict) else None for k, v in plain.report().to_dict().items()}
    plain.remove()
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="off", denoise="off",
                             decode={"route": "diffusers", "preset": "diffusers_leaf_offload_compat"})
    pipe, state = _run(blocks, components)
    in_block = state.get("ddo_reports")["decode"]["vae"].to_dict()
    ddo_blocks.blocks.remove_offload(pipe)
    got = {k: set(v) if isinstance(v, dict) else None for k, v in in_block.items() if k != "stage"}
    got["runtime"] -= {"stage_s"}
    assert got == fields
    assert {"offload_type", "use_stream"} <= fields["plan"]


def test_a_block_policy_takes_the_min_budget(components, reference):
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", text_encoder="off", decode="off",
                             denoise={"route": "linear", "vram_budget": "min"})
    pipe, state = _run(blocks, components)
    rep = state.get("ddo_reports")["denoise"]["transformer"]
    assert rep["plan"]["vram_budget"] == ddo_blocks.minimum_budget(components["transformer"])
    assert torch.equal(state.get("images"), reference)
    ddo_blocks.blocks.remove_offload(pipe)


@pytest.mark.gpu
def test_stages_on_two_gpus_give_the_one_gpu_image(flux_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the nvidia-h200-x2 machine)")
    one = ddo_blocks.wrap(FluxAutoBlocks(), device="cuda:0", text_encoder="resident", decode="resident")
    pipe, state = _run(one, load_components(flux_dir))
    ref = state.get("images").cpu()
    remove_offload(pipe)
    comps = load_components(flux_dir)
    two = ddo_blocks.wrap(FluxAutoBlocks(), device="cuda:0", text_encoder={"device": "cuda:1", "route": "resident"},
                          denoise={"route": "linear", "vram_budget": minimum_budget(comps["transformer"])},
                          decode="resident")
    pipe, state = _run(two, comps)
    assert torch.equal(state.get("images").cpu(), ref)
    reports = state.get(REPORTS_KEY)
    assert reports["text_encoder"]["text_encoder"]["stage"]["device"] == "cuda:1"
    assert reports["denoise"]["transformer"]["stage"]["device"] == "cuda:0"
    assert reports["denoise"]["transformer"]["stage"]["moved_in"] > 0  # the prompt embeddings crossed once
    remove_offload(pipe)
