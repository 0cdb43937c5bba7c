"""``graph=True`` on a real GPU: steady calls replayed as CUDA graphs give the resident output bit for
bit at every budget, one graph per start state of the slots, a new capture for new shapes, eager calls
after replays still exact, and a model that syncs with the host falls back to eager with the reason.
Marked ``gpu``: skipped without CUDA, run by hand on the GPU machine."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ddo_blocks
from ddo_blocks.tiny import flux_inputs

from .helpers import budgets
from .test_gpu import _resident_reference, medium_flux

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _clean():
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("budget_name", ["all_streamed", "half", "all_resident"])
def test_replays_equal_the_resident_forward(budget_name):
    model = medium_flux()
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, _ = _resident_reference(model, x)
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)[budget_name], device="cuda", graph=True)
    with torch.no_grad():
        outs = [model(**x)[0] for _ in range(8)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out, ref), i
    rep = handle.report()
    g = rep["graph"]
    n, k = rep["plan"]["streamed_units"], rep["plan"]["slots"]
    states = k // math.gcd(n, k) if n else 1
    assert g["status"] == "replaying", g
    assert g["captures"] == states and g["replays"] == 8 - 3, g
    # the later replays by device launch where nothing streams; torch's launch keeps copies beside compute
    if n:
        assert g["device_launch"].startswith("no: the graph streams units"), g
    else:
        assert g["device_launch"] == "yes", g
    assert g["host_replay_s"] < 0.005, g  # no per-unit Python on a replay
    # the graphs' nodes: host-to-device copies exactly where units stream
    runner = handle.engine.scheduler.graph
    for captured in runner._graphs.values():
        census = ddo_blocks._native.graph_census(captured.graph.g.raw_cuda_graph(), 0)
        assert census.get("kernel", 0) > 0 and census["edges"] > 0, census
        assert (census.get("memcpy_htod", 0) >= n) if n else "memcpy_htod" not in census, (census, n)
    timeline = rep["timeline"]
    assert len(timeline) == 8
    assert timeline[-1]["h2d_bytes"] == timeline[3]["h2d_bytes"] == timeline[2]["h2d_bytes"]  # eager = replay
    handle.remove()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_each_slot_state_gets_its_graph():
    """Block units at the minimum: an odd number of streamed units through two slots, so a call
    starts in one of two slot mappings, in turn."""
    model = medium_flux()
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, _ = _resident_reference(model, x)
    for extra in range(0, 8):
        budget = ddo_blocks.minimum_budget(model, units="block") + extra * (1 << 20)
        handle = ddo_blocks.offload(model, vram_budget=budget, device="cuda", graph=True, units="block")
        plan = handle.report()["plan"]
        if plan["streamed_units"] % plan["slots"]:
            break
        handle.remove()
    else:
        pytest.skip("no budget with a number of streamed units that is not a multiple of the slots")
    with torch.no_grad():
        for _ in range(9):
            assert torch.equal(model(**x)[0], ref)
    g = handle.report()["graph"]
    assert g["captures"] == 2 and g["graphs"] == 2 and g["replays"] == 9 - 3, g
    handle.remove()


def test_new_shapes_capture_again_and_eager_calls_between_stay_exact():
    model = medium_flux()
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    y = flux_inputs(model, height=8, width=8, text_len=16, seed=4, device="cuda")
    rx, _ = _resident_reference(model, x)
    ry, _ = _resident_reference(model, y)
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)["half"], device="cuda", graph=True)
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(model(**x)[0], rx)
        for _ in range(4):
            assert torch.equal(model(**y)[0], ry)  # eager after replays, then captured anew
        for _ in range(3):
            assert torch.equal(model(**x)[0], rx)
        # a pipeline keeps one output while it calls again (classifier-free guidance)
        a = model(**x)[0]
        b = model(**y)[0]
        assert torch.equal(a, rx) and torch.equal(b, ry)
    g = handle.report()["graph"]
    assert g["captures"] >= 2 and g["replays"] >= 4, g
    handle.remove()


def test_new_values_of_the_same_shapes_are_copied_in():
    """Replays with inputs of the same shapes and new values, a strided one (a transposed view)
    among them: each output is that input's resident one."""
    model = medium_flux()
    xs = [flux_inputs(model, height=16, width=16, text_len=32, seed=s, device="cuda") for s in (0, 5)]
    for x in xs:  # the same strided layout for both: one key
        h = x["hidden_states"]
        x["hidden_states"] = h.transpose(1, 2).contiguous().transpose(1, 2)
        assert not x["hidden_states"].is_contiguous() and torch.equal(x["hidden_states"], h)
    refs = [_resident_reference(model, x)[0] for x in xs]
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)["all_resident"], device="cuda", graph=True)
    with torch.no_grad():
        outs = [(i, model(**xs[i])[0]) for i in (0, 1, 0, 0, 1, 0, 1, 1, 0)]
    for i, out in outs:
        assert torch.equal(out, refs[i]), i
    g = handle.report()["graph"]
    assert g["replays"] >= 4 and g["device_launch"] == "yes", g
    handle.remove()


class _Syncing(nn.Module):
    """Blocks with a host sync in the forward: a graph cannot capture ``.item()``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(256, 256) for _ in range(6)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
            if x.abs().max().item() > 1e6:  # a host sync
                x = x / 2
        return x


def test_a_model_that_syncs_with_the_host_falls_back_to_eager():
    torch.manual_seed(0)
    model = _Syncing().eval()
    x = torch.randn(4, 256, device="cuda")
    with torch.no_grad():
        ref = model.to("cuda")(x)
    model.to("cpu")
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model), device="cuda", graph=True)
    rng = torch.cuda.get_rng_state()
    with torch.no_grad():
        for _ in range(6):
            assert torch.equal(model(x), ref)
    g = handle.report()["graph"]
    assert g["status"].startswith("off: capture failed"), g
    assert g["capture_failures"] == 1 and g["replays"] == 0, g
    handle.remove()
    # the failed capture left the process's random numbers working, and where they were
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    first = torch.randn(8, device="cuda")
    torch.cuda.set_rng_state(rng)
    assert torch.equal(torch.randn(8, device="cuda"), first)


class _Noisy(nn.Module):
    """Draws random numbers in its forward: a graph of it replays by torch's launch, which advances
    the generator, never by device launch."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + torch.rand_like(x)
        return x


class _OwnGenerator(_Noisy):
    """Draws from a generator of its own: a capture fails where torch needs it registered (eager
    calls), or replays by torch's launch where torch registers it lazily; never by device launch."""

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator(device="cuda").manual_seed(3)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + torch.rand(x.shape, device=x.device, generator=self.gen)
        return x


@pytest.mark.parametrize("make", [_Noisy, _OwnGenerator])
def test_a_graph_that_draws_random_numbers_draws_anew(make):
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(4, 256, device="cuda")
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model), device="cuda", graph=True)
    with torch.no_grad():
        outs = [model(x) for _ in range(8)]
    g = handle.report()["graph"]
    assert g["device_launch"] != "yes", g
    if make is _Noisy:  # the default generator: captured, replayed by torch's launch
        assert g["status"] == "replaying" and g["replays"] >= 4, g
        assert g["device_launch"].startswith("no: the graph draws random numbers"), g
    # every call drew new numbers, as eager calls do
    assert all(not torch.equal(a, b) for a, b in zip(outs, outs[1:])), g
    handle.remove()


def test_graph_with_a_codec_or_a_staging_ring_runs_eagerly_and_says_why():
    model = medium_flux()
    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, _ = _resident_reference(model, x)
    for options, why in [({"codec": "fixed"}, "codec='fixed'"), ({"preset": "low_ram_safe"}, "staging ring")]:
        budget = ddo_blocks.minimum_budget(model, codec=options.get("codec", "off"))
        handle = ddo_blocks.offload(model, vram_budget=budget, device="cuda", graph=True, **options)
        assert handle.report()["plan"]["streamed_units"] > 0
        with torch.no_grad():
            for _ in range(5):
                assert torch.equal(model(**x)[0], ref)
        g = handle.report()["graph"]
        assert g["status"].startswith("off:") and why in g["status"], g
        handle.remove()
