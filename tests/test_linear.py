"""The linear route on the CPU engine (slots in host memory, copies by memcpy): exactness for every
preset and budget, restoration, cyclic prefetch, order learning, VAE entry points, host RAM."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks.tiny import flux_inputs

from .helpers import assert_restored, budgets, snapshot

PRESETS = ["one_shot_fast", "low_ram_safe", "warm_process", "wsl_compat"]


@pytest.fixture(autouse=True)
def _no_warm_leftovers():
    yield
    ddo_blocks.release_warm_slabs()


@pytest.mark.parametrize("units", ["block", "child"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("budget_name", ["all_streamed", "half", "all_resident", "unlimited"])
def test_flux_offloaded_output_equals_resident(flux, preset, budget_name, units):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    snap = snapshot(flux)
    budget = budgets(flux, units)[budget_name]
    handle = ddo_blocks.offload(flux, preset=preset, vram_budget=budget, device="cpu", component="transformer",
                                units=units)
    plan = handle.report()["plan"]
    n_units = 5 if units == "block" else 2 * 5 + 3 * 4  # double blocks: 5 children with weights, single: 4
    assert plan["units"] == n_units
    if budget_name == "all_streamed":
        assert plan["resident_units"] == 0 and plan["streamed_units"] == n_units
    if budget_name in ("all_resident", "unlimited"):
        assert plan["streamed_units"] == 0
    if budget is not None:
        assert plan["gpu_bytes"] <= budget
    with torch.no_grad():
        outs = [flux(**x)[0] for _ in range(3)]
    for out in outs:
        assert torch.equal(out, ref)
    handle.remove()
    assert_restored(flux, snap)
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)


def test_streamed_params_are_views_into_slabs_no_second_copy(flux):
    handle = ddo_blocks.offload(flux, preset="one_shot_fast", vram_budget=budgets(flux)["all_streamed"], device="cpu",
                                units="block")
    plan = handle.report()["plan"]
    streamed = [p for u in handle.units if u.streamed for p in u.module.parameters()]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in streamed}
    # every streamed parameter is a view into one of the few slabs: no second copy
    assert streamed and len(storages) <= plan["host_slabs"]
    assert sum(storages.values()) <= plan["host_slab_bytes"] + plan["host_slabs"] * 4096  # page-aligned starts
    streamed_bytes = sum(p.numel() * p.element_size() for p in streamed)
    # exact-size slabs: the streamed bytes plus at most the 256-byte alignment of each tensor
    assert streamed_bytes <= plan["host_slab_bytes"] <= streamed_bytes + 256 * len(streamed)
    assert plan["streamed_bytes"] == sum(u.nbytes for u in handle.units if u.streamed)
    handle.remove()


@pytest.mark.parametrize("units", ["block", "child"])
def test_cyclic_prefetch_has_no_misses_after_first_call(flux, units):
    x = flux_inputs(flux)
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux, units)["all_streamed"], device="cpu", units=units)
    with torch.no_grad():
        flux(**x)
        first = handle.report()["runtime"]
        for _ in range(3):
            flux(**x)
    rt = handle.report()["runtime"]
    assert rt["calls"] == 4
    # blocks run in definition order; children of a single block run attention before the projection
    # defined ahead of it: a prefetched unit used out of turn (a reorder), never a fetch on demand
    assert first["misses"] == 0
    if units == "block":
        assert first["order_changes"] == 0 and first["reorders"] == 0
    else:
        assert first["reorders"] > 0 and first["order_changes"] == 1
    assert rt["misses"] == first["misses"]  # no misses once the order is confirmed
    assert rt["order_changes"] == first["order_changes"]
    # every call moves exactly the streamed units once (the prefetch of the next call included)
    assert rt["h2d_call_bytes"] == handle.report()["plan"]["streamed_bytes"]
    # the host's share of a call: on the CPU engine the call is all host time
    assert rt["host_call_s"] > 0 and rt["host_fraction"] == pytest.approx(1.0)
    handle.remove()


class Reversed(torch.nn.Module):
    """Runs its blocks in reverse definition order: the engine must learn the real order."""

    def __init__(self, n: int = 6, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x):
        for block in reversed(self.blocks):
            x = torch.tanh(block(x))
        return self.head(x)


def test_execution_order_is_learned_not_assumed():
    model = Reversed()
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = model(x)
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)["all_streamed"], device="cpu")
    with torch.no_grad():
        outs = [model(x) for _ in range(4)]
    assert all(torch.equal(o, ref) for o in outs)
    rt = handle.report()["runtime"]
    assert rt["order_changes"] == 1
    first_call_misses = rt["misses"]
    assert first_call_misses >= 1
    with torch.no_grad():
        model(x)
    assert handle.report()["runtime"]["misses"] == first_call_misses  # no misses once learned
    handle.remove()


@pytest.mark.parametrize("units", ["block", "child"])
def test_every_streamed_unit_is_entered(flux, vae, units):
    """A unit whose hooks never fire would compute with host weights (on a GPU: a device error).
    Containers such as ModuleList are never called, so they must never be units."""
    img = torch.randn(1, 3, 32, 32)
    for model, run in ((flux, lambda: flux(**flux_inputs(flux))), (vae, lambda: vae.decode(vae.encode(img).latent_dist.mode()))):
        handle = ddo_blocks.offload(model, vram_budget=budgets(model, units)["all_streamed"], device="cpu", units=units)
        for unit in handle.units:
            assert not isinstance(unit.module, (torch.nn.ModuleList, torch.nn.ModuleDict)), unit.name
        streamed = [u for u in handle.units if u.streamed]
        entered: set[int] = set()
        hooks = [u.module.register_forward_pre_hook(lambda m, a, i=i, seen=entered: seen.add(i))
                 for i, u in enumerate(streamed)]
        with torch.no_grad():
            run()
        for h in hooks:
            h.remove()
        assert streamed and entered == set(range(len(streamed))), "some streamed units never ran"
        handle.remove()


@pytest.mark.parametrize("preset", PRESETS)
def test_vae_encode_decode_are_hooked_and_exact(vae, preset):
    img = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lat = vae.encode(img).latent_dist.mode()
        dec = vae.decode(lat).sample
    snap = snapshot(vae)
    handle = ddo_blocks.offload(vae, preset=preset, vram_budget=budgets(vae)["all_streamed"], device="cpu",
                                component="vae")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(vae.encode(img).latent_dist.mode(), lat)
            assert torch.equal(vae.decode(lat).sample, dec)
    assert handle.report()["runtime"]["calls"] == 4  # encode and decode count as calls
    handle.remove()
    assert_restored(vae, snap)


def test_warm_process_reuses_slabs_without_copying(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    b = budgets(flux)["all_streamed"]
    first = ddo_blocks.offload(flux, preset="warm_process", vram_budget=b, device="cpu")
    assert not first.report()["setup"]["warm_reused"]
    first.remove()
    assert ddo_blocks.warm_bytes() > 0  # kept for the process
    second = ddo_blocks.offload(flux, preset="warm_process", vram_budget=b, device="cpu")
    setup = second.report()["setup"]
    assert setup["warm_reused"] and setup["packed_bytes"] == 0
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    second.remove()
    assert ddo_blocks.release_warm_slabs() > 0
    assert ddo_blocks.warm_bytes() == 0
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)


def test_one_shot_fast_frees_slabs_on_remove(flux):
    handle = ddo_blocks.offload(flux, preset="one_shot_fast", vram_budget=budgets(flux)["all_streamed"], device="cpu")
    slab_storages = {p.untyped_storage().data_ptr() for u in handle.units if u.streamed for p in u.module.parameters()}
    assert slab_storages
    handle.remove()
    assert ddo_blocks.warm_bytes() == 0
    for p in flux.parameters():
        assert p.untyped_storage().data_ptr() not in slab_storages


def test_low_ram_safe_goes_through_the_staging_ring(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = ddo_blocks.offload(flux, preset="low_ram_safe", vram_budget=budgets(flux)["all_streamed"], device="cpu")
    assert handle.report()["plan"]["staging_bytes"] == 4 * 32 * 1024 * 1024
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    assert handle.report()["memory"]["pinned_bytes"] == 0
    handle.remove()


def test_exception_inside_a_block_leaves_the_module_usable(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    boom = {"armed": True}

    def fail_once(module, args):
        if boom["armed"]:
            boom["armed"] = False
            raise RuntimeError("injected failure")

    hook = flux.single_transformer_blocks[1].register_forward_pre_hook(fail_once)
    with torch.no_grad(), pytest.raises(RuntimeError, match="injected"):
        flux(**x)
    hook.remove()
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
        assert torch.equal(flux(**x)[0], ref)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)


def test_remove_while_running_is_refused_and_harmless(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    seen = []

    def try_remove(module, args):
        with pytest.raises(ddo_blocks.OffloadStateError, match="while it is running"):
            handle.remove()
        seen.append(True)

    hook = flux.transformer_blocks[0].register_forward_pre_hook(try_remove)
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    hook.remove()
    assert seen
    handle.remove()


def test_resident_and_off_routes(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    snap = snapshot(flux)
    for route in ("resident", "off"):
        handle = ddo_blocks.offload(flux, route=route, device="cpu")
        with torch.no_grad():
            assert torch.equal(flux(**x)[0], ref)
        assert handle.report()["route"] == route
        handle.remove()
        assert_restored(flux, snap)
    handle = ddo_blocks.offload(flux, preset="off", device="cpu")
    assert handle.preset.name == "off"
    handle.remove()


def test_enable_offload_is_shaped_like_the_original(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    result = ddo_blocks.enable_offload(flux, preset="auto", component="transformer", device="cpu",
                                       vram_budget=budgets(flux)["half"])
    assert result.module is flux
    assert result.handle.preset.name in ("one_shot_fast", "low_ram_safe", "wsl_compat")
    with torch.no_grad():
        assert torch.equal(result.module(**x)[0], ref)
    assert result.report()["component"] == "transformer"
    result.remove()


def test_context_manager_removes(flux):
    snap = snapshot(flux)
    with ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu") as handle:
        assert not handle.removed
    assert handle.removed
    assert_restored(flux, snap)


def test_tied_weights_stay_resident():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 16)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
            self.layers[2].weight = self.layers[0].weight

        def forward(self, ids):
            h = self.emb(ids)
            for layer in self.layers:
                h = layer(h)
            return h

    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        ref = model(ids)
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)["all_streamed"], device="cpu")
    streamed = {id(p) for u in handle.units if u.streamed for p in u.module.parameters()}
    assert id(model.layers[0].weight) not in streamed
    with torch.no_grad():
        assert torch.equal(model(ids), ref)
    handle.remove()
    assert model.layers[2].weight is model.layers[0].weight


def test_auto_units_pick_children_when_blocks_do_not_fit(flux):
    """Below the block-level minimum, each block's children become the units (smaller slots)."""
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    block_min = budgets(flux, "block")["all_streamed"]
    child_min = budgets(flux, "child")["all_streamed"]
    assert child_min < block_min
    handle = ddo_blocks.offload(flux, vram_budget=child_min, device="cpu")
    assert handle.report()["plan"]["unit_granularity"] == "child"
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    handle.remove()
    with pytest.raises(ddo_blocks.BudgetError, match=f"\\({child_min} bytes\\)"):
        ddo_blocks.offload(flux, vram_budget=child_min - 1, device="cpu")
    with pytest.raises(ddo_blocks.ConfigError, match="unit granularity"):
        ddo_blocks.offload(flux, vram_budget=child_min, device="cpu", units="layer")


def test_inference_mode_works_like_no_grad(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    with torch.inference_mode():
        assert all(torch.equal(flux(**x)[0], ref) for _ in range(2))
    handle.remove()
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)


def test_keyboard_interrupt_mid_forward_leaves_the_offload_removable(flux):
    """Ctrl-C skips torch's always_call hooks; the call must still close (entry wrappers use finally)."""
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    armed = {"on": True}

    def interrupt(module, args):
        if armed["on"]:
            armed["on"] = False
            raise KeyboardInterrupt

    hook = flux.single_transformer_blocks[0].register_forward_pre_hook(interrupt)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        flux(**x)
    hook.remove()
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    assert handle.report()["runtime"]["order_changes"] == 0  # the interrupted call taught nothing
    handle.remove()
    assert "forward" not in vars(flux)
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)


def test_a_module_that_is_its_own_single_unit():
    """A bare leaf is one unit; two slots of it cost more than keeping it, so it stays resident."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = lin(x)
    handle = ddo_blocks.offload(lin, vram_budget=ddo_blocks.minimum_budget(lin), device="cpu")
    assert [(u.module, u.streamed) for u in handle.units] == [(lin, False)]
    with torch.no_grad():
        assert all(torch.equal(lin(x), ref) for _ in range(3))
    handle.remove()
    with torch.no_grad():
        assert torch.equal(lin(x), ref)


def test_warm_slabs_do_not_pile_up_when_the_plan_changes(flux):
    """Re-offloading warm weights at another budget repacks them; the old warm slabs are released."""
    b = budgets(flux, "block")
    sizes = []
    for budget in (b["all_streamed"], b["half"], b["all_streamed"], b["half"]):
        ddo_blocks.offload(flux, preset="warm_process", vram_budget=budget, device="cpu", units="block").remove()
        sizes.append(ddo_blocks.warm_bytes())
    assert sizes[2] == sizes[0] and sizes[3] == sizes[1]


def test_a_users_wrapper_of_forward_survives_offloading_twice(flux):
    import functools

    x = flux_inputs(flux)
    seen = []
    first = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    inner = flux.forward  # the offload's entry point: the user wraps it while offloaded

    @functools.wraps(inner)
    def traced(*a, **k):
        seen.append(1)
        return inner(*a, **k)

    flux.forward = traced
    first.remove()  # ours goes transparent under the user's wrapper
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    with torch.no_grad():
        flux(**x)
    assert seen == [1], "the user's wrapper was dropped"
    handle.remove()


def test_a_unit_called_by_hand_from_another_thread_waits_for_the_running_call(flux):
    """Thread A runs the component; thread B calls one of its streamed blocks by hand meanwhile: B waits
    for A's call to finish (one call at a time per component) and both get the right values."""
    import threading

    x = flux_inputs(flux)
    block = flux.single_transformer_blocks[0]
    seen = {}

    def capture(mod, args, kwargs, out):
        seen.setdefault("io", (args, kwargs, out))

    h = block.register_forward_hook(capture, with_kwargs=True)
    with torch.no_grad():
        ref = flux(**x)[0]
    h.remove()
    bargs, bkwargs, bref = seen["io"]
    handle = ddo_blocks.offload(flux, preset="one_shot_fast", vram_budget=budgets(flux)["all_streamed"], device="cpu",
                                units="block")
    order, inside, go_on = [], threading.Event(), threading.Event()

    def hold(mod, args):  # inside A's call: let B try, then finish
        if "a" not in order:
            order.append("a")
            inside.set()
            go_on.wait(2.0)
            order.append("a done")

    h = flux.transformer_blocks[0].register_forward_pre_hook(hold)
    out = {}

    def run_a():
        with torch.no_grad():
            out["a"] = flux(**x)[0]

    def run_b():
        inside.wait()
        with torch.no_grad():
            out["b"] = block(*bargs, **bkwargs)
        order.append("b")

    ta, tb = threading.Thread(target=run_a), threading.Thread(target=run_b)
    ta.start()
    tb.start()
    inside.wait()
    threading.Event().wait(0.2)  # B is now blocked on the lock, not running inside A's call
    go_on.set()
    ta.join()
    tb.join()
    h.remove()
    assert order == ["a", "a done", "b"]
    assert torch.equal(out["a"], ref)
    expect = bref[0] if isinstance(bref, tuple) else bref
    got = out["b"][0] if isinstance(out["b"], tuple) else out["b"]
    assert torch.equal(got, expect)
    handle.remove()
