"""``vram_budget="auto"`` on the CPU engine, with the device's free memory and the first call's
activation peak given by the test (the CPU engine has neither): the first budget is half the free
memory, the component is re-planned once after the second call (which measures each unit's
compute), outputs stay exact throughout, and failures leave a working offload or a clear error."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks import autobudget
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

from .helpers import assert_restored, snapshot


def _weights(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture
def device_memory(monkeypatch):
    """Sets what the 'device' has free and what the first call's activations measure."""
    state = {"free": 0, "activations": None}
    monkeypatch.setattr(autobudget, "free_bytes", lambda device: state["free"])
    monkeypatch.setattr(autobudget.CallPeak, "finish", lambda self: state["activations"])
    monkeypatch.setattr(autobudget, "MARGIN_BYTES", 0)
    return state


def _run(model, x):
    with torch.no_grad():
        return model(**x)[0]


def test_auto_starts_at_half_the_free_memory_and_grows_after_the_first_call(device_memory):
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    snap = snapshot(model)
    w = _weights(model)
    device_memory.update(free=int(0.8 * w), activations=int(0.05 * w))
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    first = handle.vram_budget
    assert first == int(0.4 * w) and handle.report()["plan"]["streamed_units"] > 0
    first_engine = handle.engine
    assert torch.equal(_run(model, x), ref)  # the first call measures the activations
    grown = int(0.8 * w - 0.05 * w - autobudget.MARGIN_FRACTION * 0.8 * w)
    assert handle.engine is first_engine and handle.vram_budget == first
    assert handle.report()["auto_budget"]["pending_budget_bytes"] == grown
    assert torch.equal(_run(model, x), ref)  # the second each unit's compute, then the re-plan
    assert handle.vram_budget == grown and handle.engine is not first_engine
    for _ in range(2):
        assert torch.equal(_run(model, x), ref)
    report = handle.report()
    assert report["plan"]["vram_budget"] == grown and report["plan"]["gpu_bytes"] <= grown
    assert report["plan"]["planned_with"] == "compute measured on an earlier plan"
    a = report["auto_budget"]
    assert a["first_budget_bytes"] == first and a["replanned_budget_bytes"] == grown and a["measured_compute"]
    assert a["pending_budget_bytes"] is None
    assert a["activation_bytes"] == int(0.05 * w) and "re-planned after the second call" in a["reason"]
    assert report["runtime"]["calls"] == 2  # the new engine's own calls
    handle.remove()
    assert_restored(model, snap)


def test_auto_does_not_replan_when_nothing_streams_at_first(device_memory):
    """Everything fits at the first budget: it fits at the grown one too, nothing to re-plan."""
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    w = _weights(model)
    device_memory.update(free=3 * w, activations=0)
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    assert handle.report()["plan"]["streamed_units"] == 0
    first_engine = handle.engine
    for _ in range(2):
        assert torch.equal(_run(model, x), ref)
    assert handle.engine is first_engine and handle.vram_budget == int(1.5 * w)
    assert "nothing streams" in handle.report()["auto_budget"]["reason"]
    handle.remove()


def test_a_second_call_that_fails_or_skips_units_replans_with_the_prior(device_memory):
    """The calibration call raised (or ran only part of the model): its measurement is not used; the
    re-plan follows the next clean call, with the planner's prior."""
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    w = _weights(model)
    device_memory.update(free=int(0.8 * w), activations=int(0.05 * w))
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    first_engine = handle.engine
    assert torch.equal(_run(model, x), ref)
    last = model.single_transformer_blocks[-1]

    def boom(module, args):
        raise RuntimeError("refused by the test")

    hook = last.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="refused by the test"):
        _run(model, x)
    hook.remove()
    assert handle.engine is first_engine  # no re-pack while the error unwinds
    assert torch.equal(_run(model, x), ref)  # the next clean call re-plans
    assert handle.engine is not first_engine
    a = handle.report()["auto_budget"]
    assert not a["measured_compute"] and "did not finish cleanly" in a["reason"] and a["pending_budget_bytes"] is None
    assert torch.equal(_run(model, x), ref)
    handle.remove()


def test_removed_before_the_replan_says_so(device_memory):
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    w = _weights(model)
    device_memory.update(free=int(0.8 * w), activations=int(0.05 * w))
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    _run(model, x)
    assert "waits for the second call" in handle.report()["auto_budget"]["reason"]
    handle.remove()
    assert handle.auto.pending_bytes is None and "removed before the re-plan" in handle.auto.reason


def test_child_units_measured_are_planned_as_blocks_too(device_memory):
    """units='auto' and child units at the first budget: the re-plan also plans the blocks with the
    sum of their children's measured compute, and takes whichever predicts the faster step."""
    from ddo_blocks.streaming import plan

    model = tiny_flux_transformer(num_layers=4, num_single_layers=8, num_attention_heads=4, attention_head_dim=32,
                                  joint_attention_dim=64, axes_dims_rope=(4, 14, 14))
    x = flux_inputs(model)
    ref = _run(model, x)
    w = _weights(model)
    device_memory.update(free=w, activations=0)
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    engine = handle.engine
    for _ in range(2):
        assert torch.equal(_run(model, x), ref)
    assert engine.granularity == "child"  # at the first budget (half the free memory)
    measured = engine.scheduler.calibration.resolve(len(engine.units))["unit_compute_s"]
    block = engine._block_variant(measured, handle.vram_budget)
    assert block is not None and block[1].granularity == "block"
    assert len(block[1].unit_compute_s) == 12 and abs(sum(block[1].unit_compute_s) - sum(measured)) < 1e-9
    assert handle.engine.granularity in plan.GRANULARITIES and handle.report()["auto_budget"]["measured_compute"]
    for _ in range(2):
        assert torch.equal(_run(model, x), ref)
    handle.remove()


def test_auto_keeps_the_activations_free_twice_where_graphs_may_capture(device_memory, monkeypatch):
    """graph=True on an engine that may capture: the graphs' private pool keeps a call's activations
    beside the eager allocator's. Where graphs are off (here the CPU engine), once."""
    from ddo_blocks.streaming import graph as graph_mod

    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    w = _weights(model)
    device_memory.update(free=int(0.8 * w), activations=int(0.05 * w))
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu", graph=True)
    for _ in range(3):
        assert torch.equal(_run(model, x), ref)
    assert handle.report()["auto_budget"]["activation_pools"] == 1  # the CPU engine captures nothing
    handle.remove()

    monkeypatch.setattr(graph_mod.GraphRunner, "__init__", _runner_that_may_capture(graph_mod.GraphRunner.__init__))
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu", graph=True)
    for _ in range(3):
        assert torch.equal(_run(model, x), ref)
    assert handle.vram_budget == int(0.8 * w - 2 * int(0.05 * w) - autobudget.MARGIN_FRACTION * 0.8 * w)
    a = handle.report()["auto_budget"]
    assert a["activation_pools"] == 2 and "twice (the graphs' pool" in a["reason"]
    handle.remove()


def _runner_that_may_capture(init):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.off_reason = None  # as on a GPU: the runner may capture (this test never gets that far)

    return patched


def test_the_replan_keeps_the_route_options(device_memory):
    model = tiny_flux_transformer(torch.bfloat16, num_attention_heads=4, attention_head_dim=32, joint_attention_dim=64,
                                  axes_dims_rope=(4, 14, 14))
    x = flux_inputs(model)
    ref = _run(model, x)
    w = _weights(model)
    device_memory.update(free=w, activations=0)  # the first budget is the minimum; the re-plan still streams
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu", codec="fixed", units="block")
    first = handle.engine
    for _ in range(2):  # the activations, then each unit's compute
        assert torch.equal(_run(model, x), ref)
    assert handle.engine is not first and handle.engine.granularity == "block" and handle.engine.streamed
    assert handle.report()["codec"]["codec"] == "fixed" and handle.report()["codec"]["coded_bytes"] > 0
    assert torch.equal(_run(model, x), ref)
    handle.remove()


def test_auto_keeps_its_first_budget_when_growing_is_not_worth_it_or_cannot_be_measured(device_memory):
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    w = _weights(model)
    for activations, why in ((int(0.35 * w), "not 10 % above"), (None, "no activation peak")):
        device_memory.update(free=int(0.8 * w), activations=activations)
        handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
        engine = handle.engine
        for _ in range(2):
            assert torch.equal(_run(model, x), ref)
        assert handle.engine is engine and handle.vram_budget == int(0.4 * w)
        assert why in handle.report()["auto_budget"]["reason"]
        handle.remove()


def test_a_failed_replan_attaches_the_first_budget_again(device_memory, monkeypatch):
    from ddo_blocks.streaming import engine as engine_mod

    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    snap = snapshot(model)
    w = _weights(model)
    device_memory.update(free=int(0.8 * w), activations=0)
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    first = handle.vram_budget
    real_attach = engine_mod.StreamingEngine.attach
    attaches = []

    def attach_once_failing(self):
        attaches.append(self.budget)
        if len(attaches) == 1:
            raise ddo_blocks.OffloadMemoryError("refused by the test")
        return real_attach(self)

    monkeypatch.setattr(engine_mod.StreamingEngine, "attach", attach_once_failing)
    for _ in range(2):  # the activations, then each unit's compute and the re-plan
        assert torch.equal(_run(model, x), ref)
    assert attaches == [int(0.95 * 0.8 * w), first] and handle.vram_budget == first
    assert "failed" in handle.report()["auto_budget"]["reason"]
    assert torch.equal(_run(model, x), ref)
    handle.remove()
    assert_restored(model, snap)


def test_a_replan_whose_fallback_fails_too_removes_the_offload_and_says_so(device_memory, monkeypatch):
    from ddo_blocks.streaming import engine as engine_mod

    model, x, ref, w = _tiny_auto(device_memory)
    snap = snapshot(model)
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    assert torch.equal(_run(model, x), ref)  # the activations

    def refuse(self):
        raise ddo_blocks.OffloadMemoryError("refused by the test")

    monkeypatch.setattr(engine_mod.StreamingEngine, "attach", refuse)
    with pytest.raises(ddo_blocks.OffloadStateError, match=r"so did attaching the plan that worked.*offload\(\) it again"):
        _run(model, x)  # each unit's compute, then the re-plan: both attaches refused
    assert handle.removed and ddo_blocks.get_handle(model) is None
    assert_restored(model, snap)
    assert torch.equal(_run(model, x), ref)  # a plain module again
    monkeypatch.undo()
    again = ddo_blocks.offload(model, vram_budget="auto", device="cpu")  # and it can be offloaded again
    assert torch.equal(_run(model, x), ref)
    again.remove()


def test_auto_refuses_what_it_cannot_do(device_memory):
    model = tiny_flux_transformer()
    device_memory.update(free=ddo_blocks.minimum_budget(model) - 1)
    with pytest.raises(ddo_blocks.BudgetError, match="vram_budget='auto'.*smallest plan.*is free"):
        ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    with pytest.raises(ddo_blocks.ConfigError, match="route 'resident' does not stream"):
        ddo_blocks.offload(model, route="resident", vram_budget="auto", device="cpu")
    assert ddo_blocks.get_handle(model) is None


def test_enable_offload_without_a_budget_means_auto(device_memory, monkeypatch):
    monkeypatch.delenv("DDO_VRAM_BUDGET", raising=False)
    model = tiny_flux_transformer()
    device_memory.update(free=int(0.8 * _weights(model)), activations=None)
    result = ddo_blocks.enable_offload(model, preset="auto", device="cpu")
    assert result.handle.auto is not None and result.handle.vram_budget == int(0.4 * _weights(model))
    result.handle.remove()


def test_auto_in_a_block_policy_and_a_pipeline_component(device_memory, flux_dir):
    from diffusers import FluxPipeline

    from ddo_blocks.blocks.policy import OffloadPolicy
    from ddo_blocks.tiny_pipeline import load_components

    assert OffloadPolicy(vram_budget="auto").vram_budget == "auto"
    with pytest.raises(ddo_blocks.ConfigError, match="vram_budget='auto' is a budget of a route that streams .* "
                                                      "route 'resident' does not stream"):
        OffloadPolicy(route="resident", vram_budget="auto")
    pipe = FluxPipeline(**load_components(flux_dir))
    with torch.no_grad():
        ref = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt",
                   generator=torch.Generator().manual_seed(0)).images
    w = _weights(pipe.transformer)
    device_memory.update(free=int(0.8 * w), activations=int(0.05 * w))
    with pytest.raises(ddo_blocks.ConfigError, match="pipeline budget of .* would not bound"):
        ddo_blocks.offload_pipeline(pipe, vram_budget="1GiB", device="cpu", transformer={"vram_budget": "auto"})
    with pytest.raises(ddo_blocks.ConfigError, match="'auto' is a budget of one component: pass it per component"):
        ddo_blocks.offload_pipeline(pipe, vram_budget="auto", device="cpu")
    with ddo_blocks.offload_pipeline(pipe, device="cpu", transformer={"vram_budget": "auto"}) as off:
        handle = off.handles["transformer"]
        assert handle.vram_budget == int(0.4 * w) and handle.report()["plan"]["streamed_units"] > 0
        for _ in range(2):
            with torch.no_grad():
                out = pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt",
                           generator=torch.Generator().manual_seed(0)).images
            assert torch.equal(out, ref)
        assert off.handles["transformer"].report()["auto_budget"]["replanned_budget_bytes"] is not None


@pytest.fixture(scope="module")
def flux_dir():
    from ddo_blocks.tiny_pipeline import ensure_tiny_model

    return ensure_tiny_model("flux")


def test_a_second_call_through_another_entry_point_replans_with_the_prior(device_memory):
    """A VAE decoded first and encoded second: the encode measured only the encoder's units, so its
    measurement would plan the decoder as free of compute; the re-plan uses the prior instead."""
    from ddo_blocks.tiny import tiny_autoencoder_kl

    vae = tiny_autoencoder_kl()
    img = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lat = vae.encode(img).latent_dist.mode()
        ref_dec, ref_lat = vae.decode(lat).sample, lat
    w = _weights(vae)
    device_memory.update(free=int(0.8 * w), activations=0)
    handle = ddo_blocks.offload(vae, vram_budget="auto", device="cpu")
    assert handle.report()["plan"]["streamed_units"] > 0
    first = handle.engine
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, ref_dec)
        assert torch.equal(vae.encode(img).latent_dist.mode(), ref_lat)
        assert handle.engine is not first
        a = handle.report()["auto_budget"]
        assert not a["measured_compute"] and "did not run every unit" in a["reason"]
        assert torch.equal(vae.decode(lat).sample, ref_dec)
    handle.remove()


def _tiny_auto(device_memory):
    """The tiny transformer, its input, its resident output and its weights' bytes; the "device" with 0.8x
    of those bytes free and first-call activations of 0.05x."""
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    w = _weights(model)
    device_memory.update(free=int(0.8 * w), activations=int(0.05 * w))
    return model, x, ref, w


class _OutOfMemoryAbove:
    """A pre-hook on a block that raises CUDA's out-of-memory error while the offload's budget is above
    ``handle._smallest`` (the activations of a first call that do not fit beside the first budget), at
    most ``times`` times (``always``: at the smallest plan too)."""

    def __init__(self, times: int = 1, always: bool = False):
        self.handle, self.times, self.always, self.raised = None, times, always, 0

    def __call__(self, module, args):
        if self.raised < self.times and (self.always or self.handle.vram_budget > self.handle._smallest):
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")


def _offload_failing_first(model, hook):
    h = model.transformer_blocks[-1].register_forward_pre_hook(hook)
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    hook.handle = handle
    return handle, h


def test_a_first_call_out_of_memory_attaches_the_smallest_plan_and_says_to_call_again(device_memory):
    model, x, ref, w = _tiny_auto(device_memory)
    snap = snapshot(model)
    hook = _OutOfMemoryAbove()
    handle, h = _offload_failing_first(model, hook)
    first = handle.vram_budget
    assert first == int(0.4 * w) and handle._smallest == ddo_blocks.minimum_budget(model) < first
    with pytest.raises(torch.OutOfMemoryError, match="raised by the test") as info:
        _run(model, x)
    note = "\n".join(info.value.__notes__)
    assert "is attached at its smallest plan" in note and "call it again" in note
    assert hook.raised == 1 and handle.vram_budget == handle._smallest
    assert handle.auto.activation_bytes is None  # the failed call measured nothing
    assert torch.equal(_run(model, x), ref)  # called again: at the smallest plan, it measures the activations
    a = handle.report()["auto_budget"]
    assert a["out_of_memory_at_bytes"] == first and a["first_budget_bytes"] == handle._smallest
    assert a["reason"].startswith("the first call ran out of device memory at the first budget")
    assert a["pending_budget_bytes"] == int(0.8 * w - 0.05 * w - autobudget.MARGIN_FRACTION * 0.8 * w)
    assert torch.equal(_run(model, x), ref)  # the calibration call, then the re-plan with what it measured
    grown = handle.vram_budget
    assert grown == a["pending_budget_bytes"] and handle.engine.on_oom is None
    for _ in range(2):
        assert torch.equal(_run(model, x), ref)
    assert handle.report()["auto_budget"]["replanned_budget_bytes"] == grown and hook.raised == 1
    handle.remove()
    h.remove()
    assert_restored(model, snap)


def test_a_call_out_of_memory_at_the_smallest_plan_says_so_and_the_offload_stays_usable(device_memory):
    model, x, ref, w = _tiny_auto(device_memory)
    snap = snapshot(model)
    hook = _OutOfMemoryAbove(times=2, always=True)  # the first budget, then the smallest plan too
    handle, h = _offload_failing_first(model, hook)
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError) as info:
            _run(model, x)
    notes = "\n".join(info.value.__notes__)
    assert hook.raised == 2 and "ran out of device memory at its smallest plan" in notes
    assert handle.vram_budget == handle._smallest and handle.auto.activation_bytes is None
    assert torch.equal(_run(model, x), ref)  # memory freed: the next call measures
    assert handle.auto.activation_bytes == int(0.05 * w)
    handle.remove()
    h.remove()
    assert_restored(model, snap)


def test_an_out_of_memory_after_the_first_call_changes_nothing(device_memory):
    model, x, ref, w = _tiny_auto(device_memory)
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    assert torch.equal(_run(model, x), ref)
    engine, budget = handle.engine, handle.vram_budget
    hook = _OutOfMemoryAbove(always=True)
    hook.handle = handle
    h = model.transformer_blocks[-1].register_forward_pre_hook(hook)
    with pytest.raises(torch.OutOfMemoryError) as info:
        _run(model, x)
    assert not getattr(info.value, "__notes__", None) and handle.engine is engine and handle.vram_budget == budget
    h.remove()
    handle.remove()


def test_an_interrupted_first_call_measures_nothing(device_memory):
    model, x, ref, w = _tiny_auto(device_memory)
    handle = ddo_blocks.offload(model, vram_budget="auto", device="cpu")
    first = handle.vram_budget

    def fail(module, args):
        raise ValueError("refused by the test")

    h = model.transformer_blocks[-1].register_forward_pre_hook(fail)
    device_memory.update(activations=1)  # what the interrupted call's peak would understate
    with pytest.raises(ValueError, match="refused by the test"):
        _run(model, x)
    h.remove()
    assert handle.auto.activation_bytes is None and not handle.auto.done and handle.vram_budget == first
    device_memory.update(activations=int(0.05 * w))
    assert torch.equal(_run(model, x), ref)  # the first clean call measures
    assert handle.auto.activation_bytes == int(0.05 * w) and handle.auto.pending_bytes is not None
    handle.remove()


def test_a_first_call_out_of_memory_of_a_module_from_the_device_is_not_reattached(device_memory):
    model, x, ref, w = _tiny_auto(device_memory)
    hook = _OutOfMemoryAbove()
    handle, h = _offload_failing_first(model, hook)
    engine, first = handle.engine, handle.vram_budget
    engine.orig_device[-1] = torch.device("cuda", 0)  # as if a weight had come from the GPU (no parameter has id -1)
    with pytest.raises(torch.OutOfMemoryError) as info:
        _run(model, x)
    assert "came from the device" in "\n".join(info.value.__notes__)
    assert handle.engine is engine and handle.vram_budget == first  # re-attaching would put every weight back first
    del engine.orig_device[-1]
    assert torch.equal(_run(model, x), ref)
    handle.remove()
    h.remove()
