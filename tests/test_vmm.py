"""The vmm route on the CPU, over the host emulation of the arena (``HostChunks``: a range is ordinary
memory, an unmapped chunk is overwritten with 0xFF, so a weight used without its restore is NaN):
exactness at every budget, two components sharing one budget (eviction, restore at the same addresses,
the cap), restoration on remove, and every refusal. The CUDA arena itself: tests/test_gpu_vmm.py."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks.streaming.arena import Arena, HostChunks
from ddo_blocks.tiny import flux_inputs

from .helpers import assert_restored, budgets, snapshot

CHUNK = 4096


def host_arena(budget: int) -> Arena:
    return Arena(budget, _backend=HostChunks(CHUNK, budget))


def slack(n: int, module: torch.nn.Module | None = None) -> int:
    """What a budget needs beyond the plan: the home and slot ranges round up to whole chunks, each
    unit to 256 bytes (``Arena.reserve_bytes``)."""
    from ddo_blocks.units import split_units

    found = split_units(module)[0] if module is not None else []
    return n + 2 * CHUNK + 256 * (sum(len(u.params) for u in found) + len(found))


@pytest.mark.parametrize("budget_name", ["all_streamed", "half", "all_resident"])
def test_flux_on_the_arena_equals_resident(flux, budget_name):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    snap = snapshot(flux)
    arena = host_arena(slack(budgets(flux)[budget_name], flux))
    handle = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    assert handle.route == "vmm" and handle.preset.name == "vmm_fast"
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(flux(**x)[0], ref)
    rep = handle.report()
    fig = arena.report()
    assert rep["arena"]["peak_device_bytes"] == fig["peak_device_bytes"] <= arena.budget
    assert rep["arena"]["transformer_mapped_bytes"] == fig["members"]["transformer"]["mapped_bytes"]
    assert fig["members"]["transformer"]["resident_units"] == rep["plan"]["resident_units"]
    if budget_name == "all_resident":
        assert rep["plan"]["streamed_units"] == 0
    handle.remove()
    assert_restored(flux, snap)
    assert arena.members == [] and arena.mapped_chunks() == 0
    arena.close()


def _vae_io(vae):
    img = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lat = vae.encode(img).latent_dist.mode()
        dec = vae.decode(lat).sample
    return lat, dec


def _pair(flux, vae):
    """The transformer's input and output, the VAE's latents and decode, both models' budgets."""
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    return x, ref, *_vae_io(vae), budgets(flux), budgets(vae, "block")


def test_two_components_share_one_budget_and_get_their_pages_back(flux, vae):
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    # each fits whole on its own, both together do not
    budget = max(slack(bf["all_resident"], flux), slack(bv["all_resident"], vae)) + 4 * CHUNK
    assert bf["all_resident"] + bv["all_resident"] > budget
    arena = host_arena(budget)
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    home = {n: p.data_ptr() for n, p in flux.named_parameters()}  # before the VAE takes pages
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")
    with torch.no_grad():
        for _ in range(3):  # a cycle of phases: each call takes pages from the other
            assert torch.equal(flux(**x)[0], ref)
            assert torch.equal(vae.decode(lat).sample, dec)
    fig = arena.report()
    assert fig["evictions"] > 0 and fig["evicted_bytes"] > 0
    assert fig["restored_bytes"] > bf["all_resident"]  # the transformer's units came back at least once
    assert fig["peak_mapped_bytes"] + fig["fixed_bytes"] <= budget
    assert fig["members"]["transformer"]["restores"] >= 2
    with torch.no_grad():
        flux(**x)
    # every resident weight is back at the address it had after attach (stable addresses)
    resident = {n for u in hf.units if not u.streamed for n, _ in u.module.named_parameters(prefix=u.name)}
    assert resident
    now = dict(flux.named_parameters())
    assert all(now[n].data_ptr() == home[n] for n in resident)
    hv.remove()
    hf.remove()
    arena.close()


def test_an_evicted_unit_points_at_its_host_copy(flux, vae):
    bf, bv = budgets(flux), budgets(vae, "block")
    arena = host_arena(max(slack(bf["all_resident"], flux), slack(bv["all_resident"], vae)) + 4 * CHUNK)
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu")
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu")
    member = next(m for m in arena.members if m.engine.module is flux)
    lat, _ = _vae_io(vae)
    with torch.no_grad():
        vae.decode(lat)
    evicted = [i for i, ok in enumerate(member.loaded) if not ok]
    assert evicted
    base, end = member.home.data_ptr(), member.home.data_ptr() + member.home.numel()
    for i in evicted:
        for _, p in member.units[i].params:
            assert not base <= p.data_ptr() < end  # the host copy, not the unmapped home
            assert torch.isfinite(p).all()
    hv.remove()
    hf.remove()


def test_the_cpu_without_a_test_arena_is_refused(flux):
    snap = snapshot(flux)
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="needs a CUDA device"):
        ddo_blocks.offload(flux, route="vmm", vram_budget="1GiB", device="cpu")
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="needs a CUDA device"):
        ddo_blocks.Arena("1GiB", device="cpu")
    assert_restored(flux, snap)
    assert ddo_blocks.get_handle(flux) is None


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"arena": "big"}, ddo_blocks.ConfigError, "arena= takes a ddo_blocks.Arena"),
    ({}, ddo_blocks.ConfigError, "route='vmm' needs a VRAM budget"),
    ({"vram_budget": 1 << 40, "arena": "ARENA"}, ddo_blocks.ConfigError, "at most the arena's"),
    ({"arena": "ARENA", "codec": "gzip"}, ddo_blocks.ConfigError, "is not a codec"),
    ({"arena": "ARENA", "offload_type": "leaf_level"}, ddo_blocks.ConfigError, "does not take offload_type"),
    ({"vram_budget": "auto"}, ddo_blocks.CudaNotAvailableError, "needs a CUDA device"),
])
def test_bad_options_are_refused_and_leave_the_module(flux, kwargs, error, match):
    arena = host_arena(slack(budgets(flux)["all_resident"], flux))
    kwargs = {k: (arena if v == "ARENA" else v) for k, v in kwargs.items()}
    snap = snapshot(flux)
    with pytest.raises(error, match=match):
        ddo_blocks.offload(flux, route="vmm", device="cpu", **kwargs)
    assert_restored(flux, snap)
    assert arena.members == []


def test_a_budget_too_small_for_a_second_member_is_refused(flux):
    from ddo_blocks.tiny import tiny_flux_transformer

    arena = host_arena(slack(budgets(flux)["all_streamed"], flux))
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu")
    other = tiny_flux_transformer(seed=1)  # its fixed weights beside the first one's leave too little
    snap = snapshot(other)
    with pytest.raises(ddo_blocks.BudgetError, match="vram_budget"):
        ddo_blocks.offload(other, route="vmm", arena=arena, device="cpu")
    assert_restored(other, snap)
    assert ddo_blocks.get_handle(other) is None and len(arena.members) == 1
    with pytest.raises(ddo_blocks.ConfigError, match="still holds"):
        arena.close()
    x = flux_inputs(flux)
    with torch.no_grad():
        flux(**x)  # the first member still works
    hf.remove()
    arena.close()


def test_the_route_is_in_the_preset_table():
    assert ddo_blocks.routes.resolve("vmm", "auto").name == "vmm_fast"
    assert "vmm_fast" in ddo_blocks.routes.describe()


def test_offload_pipeline_vmm_fast_needs_a_budget_and_cuda():
    from diffusers import FluxPipeline

    from ddo_blocks.tiny_pipeline import ensure_tiny_model, load_components

    pipe = FluxPipeline(**load_components(ensure_tiny_model("flux")))
    with pytest.raises(ddo_blocks.ConfigError, match="pass vram_budget="):
        ddo_blocks.offload_pipeline(pipe, preset="vmm_fast", device="cpu")
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="needs a CUDA device"):
        ddo_blocks.offload_pipeline(pipe, preset="vmm_fast", vram_budget="1GiB", device="cpu")
    mods = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert all(ddo_blocks.get_handle(m) is None for m in mods)


def test_modular_stages_share_one_arena():
    """wrap() with every stage on one Arena (a policy option): the image of the pipeline without offloading."""
    from diffusers.modular_pipelines import FluxAutoBlocks

    from ddo_blocks.blocks import remove_offload
    from ddo_blocks.tiny_pipeline import CALL_DEFAULTS, ensure_tiny_model, load_components

    def run(blocks, components):
        pipe = blocks.init_pipeline()
        pipe.update_components(**components)
        return pipe, pipe(prompt="a cat on a tree", generator=torch.Generator().manual_seed(0), output_type="pt",
                          **CALL_DEFAULTS["flux"])

    root = ensure_tiny_model("flux")
    _, ref = run(FluxAutoBlocks(), load_components(root))
    components = load_components(root)
    sizes = {n: sum(p.numel() * p.element_size() for p in components[n].parameters())
             for n in ("text_encoder", "text_encoder_2", "transformer", "vae")}
    arena = host_arena(slack(sizes["transformer"], components["transformer"]) + 8 * CHUNK)
    assert sum(sizes.values()) > arena.budget  # they do not all fit at once
    blocks = ddo_blocks.wrap(FluxAutoBlocks(), device="cpu", preset="vmm_fast", arena=arena)  # every stage on it
    pipe, state = run(blocks, components)
    assert torch.equal(state.get("images"), ref.get("images"))
    assert {m.name for m in arena.members} == {"text_encoder", "text_encoder_2", "transformer", "vae"}
    assert arena.report()["evictions"] > 0
    _, again = pipe, pipe(prompt="a cat on a tree", generator=torch.Generator().manual_seed(0), output_type="pt",
                          **CALL_DEFAULTS["flux"])
    assert torch.equal(again.get("images"), ref.get("images"))
    assert remove_offload(pipe) == 4
    assert arena.members == []
    arena.close()


def test_a_mapping_that_fails_at_attach_leaves_the_module_and_the_arena(flux, monkeypatch):
    """cuMemCreate out of memory (here: the emulation's map raising it) during attach: the module is
    as it was, the arena holds nothing of it, and a later attach works."""
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    snap = snapshot(flux)
    arena = host_arena(slack(budgets(flux)["half"], flux))

    def no_memory(*a, **k):
        raise ddo_blocks.OffloadMemoryError("out of memory: cuMemCreate while creating a chunk (test)")

    monkeypatch.setattr(arena.backend, "map", no_memory)
    with pytest.raises(ddo_blocks.OffloadMemoryError, match="cuMemCreate"):
        ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu")
    assert_restored(flux, snap)
    assert ddo_blocks.get_handle(flux) is None and arena.members == [] and arena.mapped_chunks() == 0
    monkeypatch.undo()
    handle = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu")
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    handle.remove()
    assert_restored(flux, snap)


def test_replan_and_remove_in_any_order_keep_the_arena_consistent(flux, vae):
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    arena = host_arena(max(slack(bf["half"], flux), slack(bv["all_resident"], vae)) + 4 * CHUNK)
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")
    with torch.no_grad():
        flux(**x)
        flux(**x)
    hf.replan(min_gain=-1.0)  # attached again (or kept) on the same arena, under the same name
    assert sorted(m.name for m in arena.members) == ["transformer", "vae"]
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, dec)
        assert torch.equal(flux(**x)[0], ref)
    hf.remove()  # the first member leaves; the other keeps working and can take the whole arena
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, dec)
    assert [m.name for m in arena.members] == ["vae"]
    hv.remove()
    assert arena.mapped_chunks() == 0 and arena.backend.stats()["mapped"] == 0
    arena.close()


def _net(n_blocks: int = 8, width: int = 256, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n_blocks))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return Net().eval()


def test_a_member_running_in_another_thread_is_never_evicted():
    """A streamed unit called on its own in one thread while another member needs its chunks: the other
    call is refused with a BudgetError naming the running member; the running unit's output is right."""
    import threading

    a, b = _net(seed=0), _net(seed=1)
    x = torch.randn(4, 256)
    with torch.no_grad():
        ref = a.blocks[5](x)
    unit = 256 * 257 * 4
    budget = 8 * unit + 2 * CHUNK + 64 * CHUNK  # one net resident, not two
    arena = host_arena(budget)
    ha = ddo_blocks.offload(a, route="vmm", arena=arena, device="cpu", vram_budget=3 * unit, component="a")
    hb = ddo_blocks.offload(b, route="vmm", arena=arena, device="cpu", component="b")
    with torch.no_grad():
        a(x)  # a takes its chunks back from b
    go, done, errors = threading.Event(), threading.Event(), []

    def other():
        go.wait()
        try:
            with torch.no_grad():
                b(x)
        except ddo_blocks.BudgetError as exc:
            errors.append(str(exc))
        done.set()

    t = threading.Thread(target=other)
    t.start()

    def inside(mod, args):  # inside a.blocks[5], its weights bound to a slot
        go.set()
        done.wait()

    h = a.blocks[5].register_forward_pre_hook(inside)
    with torch.no_grad():
        out = a.blocks[5](x)
    h.remove()
    t.join()
    assert torch.equal(out, ref)
    assert errors and "a hold(s) the rest and is running now" in errors[0]
    with torch.no_grad():
        assert torch.equal(b(x), b(x))  # b works once a is done
    hb.remove()
    ha.remove()
    arena.close()


def test_a_failure_freeing_a_range_still_takes_the_member_out(flux, vae, monkeypatch):
    bf, bv = budgets(flux), budgets(vae, "block")
    arena = host_arena(max(slack(bf["all_resident"], flux), slack(bv["all_resident"], vae)) + 4 * CHUNK)
    snap = snapshot(flux)
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")
    real = arena.backend.free_range
    calls = []

    def flaky(base):
        calls.append(base)
        if len(calls) <= 2:  # the first range fails twice (the retry too)
            raise ddo_blocks.CudaError("cuMemAddressFree failed (test)")
        real(base)

    monkeypatch.setattr(arena.backend, "free_range", flaky)
    with pytest.raises(ddo_blocks.CudaError, match="cuMemAddressFree"):
        hf.remove()
    assert_restored(flux, snap)
    assert [m.name for m in arena.members] == ["vae"]
    lat, dec = _vae_io(vae)
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, dec)  # the other member takes the whole arena
    hv.remove()
    arena.close()


def test_from_pretrained_onto_an_arena(flux_checkpoints):
    from diffusers import FluxTransformer2DModel

    root, _, x, ref = flux_checkpoints
    arena = host_arena(64 << 20)
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, root / "sharded", route="vmm", arena=arena,
                                        device="cpu")
    assert handle.route == "vmm" and [m.name for m in arena.members] == [handle.component]
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)
    handle.remove()
    arena.close()


@pytest.mark.parametrize("codec", ["fixed", "tiered"])
def test_coded_units_on_a_shared_arena(vae, codec):
    """Compressed transfer on the vmm route: the transformer's streamed bf16 units held and sent coded,
    both members exact."""
    from ddo_blocks.tiny import tiny_flux_transformer

    flux = tiny_flux_transformer(dtype=torch.bfloat16)
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    arena = host_arena(max(slack(bf["half"], flux), slack(bv["all_resident"], vae)) + 4 * CHUNK)
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", codec=codec, component="transformer")
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")
    rep = hf.report()
    assert rep["codec"]["codec"] == codec and rep["codec"]["coded_units"] > 0
    assert rep["codec"]["host_bytes"] < rep["codec"]["raw_bytes"]  # fewer bytes held and sent
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(flux(**x)[0], ref)
            assert torch.equal(vae.decode(lat).sample, dec)
    hv.remove()
    hf.remove()
    arena.close()


def _two_nets():
    """Two 8-block nets, an input, the second's output, the bytes of one block, and an arena that holds
    one net whole but not both."""
    a, b = _net(seed=0), _net(seed=1)
    x = torch.randn(4, 256)
    with torch.no_grad():
        ref = b(x)
    unit = 256 * 257 * 4
    return a, b, x, ref, unit, host_arena(8 * unit + 2 * CHUNK + 64 * CHUNK)


def test_a_failed_fetch_at_a_restore_keeps_every_slot():
    """A fetch that fails while a member's slots come back (a deferred CUDA error, say): that call raises
    the DdoError, and the next call finds both slots and gives the right output."""
    a, b, x, ref, unit, arena = _two_nets()
    hb = ddo_blocks.offload(b, route="vmm", arena=arena, device="cpu", component="b", vram_budget=3 * unit)
    ha = ddo_blocks.offload(a, route="vmm", arena=arena, device="cpu", component="a")
    store, sched = hb.engine.store, hb.engine.scheduler
    real, fail = store.fetch, {"on": False}

    def flaky(transport, u, slot, dst):
        if fail["on"]:
            fail["on"] = False
            raise ddo_blocks.CudaError("deferred error (test)")
        real(transport, u, slot, dst)

    store.fetch = flaky
    for _ in range(3):
        with torch.no_grad():
            a(x)  # a takes b's slots
        fail["on"] = True
        with pytest.raises(ddo_blocks.CudaError, match="deferred error"), torch.no_grad():
            b(x)
        assert len(sched._free) + len(sched._inflight) == hb.engine.slots.n_slots
        with torch.no_grad():
            assert torch.equal(b(x), ref)
    ha.remove()
    hb.remove()
    arena.close()


def test_a_member_is_not_evicted_before_its_first_prefetches_are_queued(monkeypatch):
    import threading

    from ddo_blocks.streaming import engine as eng

    a, b, x, ref, unit, arena = _two_nets()
    ha = ddo_blocks.offload(a, route="vmm", arena=arena, device="cpu", component="a")  # all resident
    real_fetch, armed, errors = eng.StreamingEngine.fetch, {"on": True}, []

    def fetch(self, u, slot):  # inside b's first prefetches: another thread calls a meanwhile
        real_fetch(self, u, slot)
        if self.module is b and armed["on"] and self._attached:
            armed["on"] = False

            def call_a():
                try:
                    with torch.no_grad():
                        a(x)
                except ddo_blocks.BudgetError as exc:  # refused: b is still attaching
                    errors.append(str(exc))

            t = threading.Thread(target=call_a)
            t.start()
            t.join()

    monkeypatch.setattr(eng.StreamingEngine, "fetch", fetch)
    hb = ddo_blocks.offload(b, route="vmm", arena=arena, device="cpu", component="b", vram_budget=3 * unit)
    monkeypatch.undo()
    assert not armed["on"] and errors and "b hold(s) the rest" in errors[0]
    with torch.no_grad():
        assert torch.equal(b(x), ref)
    hb.remove()
    ha.remove()
    arena.close()


def test_a_component_checked_before_it_joins_is_left_room():
    """The vmm route's check tells the arena a component that will join: one that plans with the whole
    arena before it leaves that component's fixed bytes free, so the later join is not refused."""
    from ddo_blocks.blocks import OffloadPolicy

    a, late = _net(seed=0), _net(seed=1)
    late.register_buffer("table", torch.zeros(64 * 1024))  # 256 KiB outside the arena
    unit = 256 * 257 * 4
    arena = host_arena(8 * unit + 2 * CHUNK + 8 * CHUNK)
    OffloadPolicy(route="vmm", options={"arena": arena}).check(torch.device("cpu"), late, "late")
    assert arena.expected["late"] >= 64 * 1024 * 4
    ha = ddo_blocks.offload(a, route="vmm", arena=arena, device="cpu", component="a")
    hl = ddo_blocks.offload(late, route="vmm", arena=arena, device="cpu", component="late", vram_budget="min")
    assert arena.expected == {} and arena.report()["peak_device_bytes"] <= arena.budget
    hl.remove()
    ha.remove()
    arena.close()


def test_a_private_arena_keeps_no_host_copy_of_its_resident_units(flux):
    """offload(route="vmm", vram_budget=...) alone: nothing else can take its chunks, so its resident
    units live only in the arena (host RAM as on the linear route); remove() copies them back."""
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    snap = snapshot(flux)
    arena = host_arena(slack(budgets(flux)["half"], flux))
    arena.private = True  # what offload(route="vmm", vram_budget=...) makes
    handle = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    member = arena.members[0]
    assert member.units and member.host is None
    assert arena.report()["members"]["transformer"]["host_copy_bytes"] == 0
    lo, hi = member.home.data_ptr(), member.home.data_ptr() + member.home.numel()
    assert all(lo <= p.data_ptr() < hi for u in member.units for _, p in u.params)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(flux(**x)[0], ref)
    handle.remove()
    assert_restored(flux, snap)
    assert arena.closed  # a private arena goes with its only member


def _fake_auto(monkeypatch, free: int, peak) -> None:
    """``Arena("auto")`` on the host emulation: ``free`` bytes free, no margin, and each call's
    activation peak given by ``peak()`` instead of measured."""
    from ddo_blocks import autobudget

    class FakePeak:
        def __init__(self, device):
            pass

        def start(self):
            pass

        def finish(self):
            return peak()

    monkeypatch.setattr(autobudget, "free_bytes", lambda device: free)
    monkeypatch.setattr(autobudget, "MARGIN_BYTES", 0)
    monkeypatch.setattr(autobudget, "MARGIN_FRACTION", 0.0)
    monkeypatch.setattr(autobudget, "CallPeak", FakePeak)


def _auto_arena(monkeypatch, whole: int, peak) -> tuple[int, Arena]:
    """An ``Arena("auto")`` on the host emulation with 1.5x ``whole`` free (half of it: the first budget);
    ``peak(free)`` gives each call's activations."""
    free = 3 * whole // 2
    _fake_auto(monkeypatch, free, lambda: peak(free))
    return free, Arena("auto", _backend=HostChunks(CHUNK, free))


def test_an_auto_arena_sizes_each_phase_from_its_activations(flux, vae, monkeypatch):
    """Arena("auto"): half the free memory until a member's first call measured its activations; then
    each member's calls run with the free memory less its own activations (the margin set to 0 here):
    the transformer is planned again with its larger phase budget, and the VAE's activation-heavy
    phase takes the transformer's chunks and gives them back to the allocator. Outputs stay exact."""
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    free = 3 * slack(bf["all_resident"], flux) // 2  # the first budget (half) streams the transformer
    acts = {"transformer": free // 50, "vae": free * 7 // 10}  # the VAE's decode needs much more
    owner: list[str] = []
    _fake_auto(monkeypatch, free, lambda: acts[owner[-1]])
    arena = Arena("auto", _backend=HostChunks(CHUNK, free))
    assert arena.budget == free // 2
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")
    first_budget, first_streamed = hf.engine.budget, hf.report()["plan"]["streamed_bytes"]
    owner.append("transformer")
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)  # measures; then planned again with free - its activations
    assert arena.auto.activations["transformer"] == acts["transformer"]
    assert hf.engine.budget > 1.5 * first_budget  # planned with its phase's budget, not the first one
    assert hf.report()["plan"]["streamed_bytes"] < first_streamed
    owner.append("vae")
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, dec)
        assert torch.equal(vae.decode(lat).sample, dec)  # a phase of free - the VAE's activations
    mv = next(m for m in arena.members if m.name == "vae")
    assert arena.budget == max(free - acts["vae"], mv.working_chunks() * CHUNK + arena.fixed_bytes) < free // 2
    assert arena.backend.max_chunks * CHUNK <= arena.budget  # the pool shrank with the phase
    assert arena.mapped_chunks() * CHUNK + arena.fixed_bytes <= arena.budget
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)  # its phase again: its chunks come back
    assert arena.budget == free - acts["transformer"]
    fig = arena.report()
    assert fig["auto_free_bytes"] == free and fig["vae_activation_bytes"] == acts["vae"]
    hv.remove()
    hf.remove()
    arena.close()


def test_an_auto_arena_member_whose_first_call_runs_out_of_memory_gets_a_phase_of_its_own(flux, vae, monkeypatch):
    """Arena("auto") on a small card: the VAE's first decode runs out of device memory beside the
    arena's first budget (half the free memory). The error says to call again; the VAE is attached at
    its smallest plan and its phase holds none of the transformer's chunks until its activations are
    measured, while the transformer still joins and is planned again beside it; the next decode
    measures them and the VAE is planned again with its phase's budget (no floor of a quarter of the
    free memory: its activations take most of the card). Outputs stay exact."""
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    acts = {"transformer": 0, "vae": 0}
    owner: list[str] = []
    free, arena = _auto_arena(monkeypatch, slack(bf["all_resident"], flux), lambda free: acts[owner[-1]])
    acts.update(transformer=free // 50, vae=free * 8 // 10)  # 1 - 0.8 is below the old floor of 1/4
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")
    first_vae, first_flux = hv.engine.budget, hf.engine.budget
    seen: list[tuple[int, int, int]] = []

    def out_of_memory(module, args):
        if not arena.auto.squeezed:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        mv = next(m for m in arena.members if m.name == "vae")  # inside the measuring call: its phase
        seen.append((arena.budget, mv.working_chunks() * CHUNK + arena.fixed_bytes,
                     arena.mapped_chunks() - mv.mapped_chunks()))

    h = vae.decoder.mid_block.register_forward_pre_hook(out_of_memory)
    owner.append("vae")
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError) as info:
        vae.decode(lat)
    assert "call it again" in "\n".join(info.value.__notes__)
    assert arena.auto.squeezed == {"vae"} and "vae" not in arena.auto.activations
    smallest = hv.engine.budget
    assert smallest < first_vae and hv.engine.streamed and arena.auto.phase_budget("vae") == 0
    owner.append("transformer")
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)  # measures; planned again (a join) beside the squeezed VAE
    assert hf.engine.attached and hf.engine.budget > 1.5 * first_flux
    owner.append("vae")
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, dec)  # measures, then planned with its phase
    assert len(seen) == 1 and seen[0][0] == seen[0][1] and seen[0][2] == 0  # the others held no chunk in it
    assert arena.auto.activations["vae"] == acts["vae"]
    assert arena.auto.phase_budget("vae") == free - acts["vae"] < free // 4
    assert hv.engine.budget > smallest and hv.engine.on_oom is None
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, dec)
    mv = next(m for m in arena.members if m.name == "vae")
    assert arena.budget == max(free - acts["vae"], mv.working_chunks() * CHUNK + arena.fixed_bytes)
    assert arena.mapped_chunks() * CHUNK + arena.fixed_bytes <= arena.budget
    owner.append("transformer")
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)  # its phase again
    assert hf.engine.attached and arena.report()["auto_out_of_memory_at_first_call"] == ["vae"]
    hv.remove()
    hf.remove()
    h.remove()
    arena.close()


def test_an_auto_arena_member_with_a_budget_of_its_own_squeezed_stays_within_it(flux, vae, monkeypatch):
    """A member given its own smallest budget (``"min"``, as vmm_fast gives text encoders) whose first
    call runs out of memory: its phase is squeezed, nothing is attached again (it already is at its
    smallest plan), not even after the measuring call (its phase cannot take it above its own budget);
    a module whose weights came from the device is not attached again at all (that would put them back
    first)."""
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    free, arena = _auto_arena(monkeypatch, slack(bf["all_resident"], flux), lambda free: free // 50)
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae", vram_budget="min")
    engine = hv.engine
    fail = {"left": 1}

    def out_of_memory(module, args):
        if fail["left"]:
            fail["left"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    h = vae.decoder.mid_block.register_forward_pre_hook(out_of_memory)
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError) as info:
        vae.decode(lat)
    assert "call it again" in "\n".join(info.value.__notes__) and arena.auto.squeezed == {"vae"}
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(vae.decode(lat).sample, dec)
    assert hv.engine is engine and "vae" in arena.auto.activations
    hv.remove()
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    hf.engine.orig_device[-1] = torch.device("cuda", 0)  # as if a weight had come from the GPU (no parameter has id -1)
    engine = hf.engine
    h2 = flux.transformer_blocks[-1].register_forward_pre_hook(out_of_memory)
    fail["left"] = 1
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError) as info:
        flux(**x)
    assert "came from the device" in "\n".join(info.value.__notes__)
    assert hf.engine is engine and "transformer" not in arena.auto.squeezed
    del hf.engine.orig_device[-1]
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    hf.remove()
    h.remove()
    h2.remove()
    arena.close()


def test_an_auto_arena_member_interrupted_at_its_first_call_is_planned_again_after_a_clean_one(flux, vae,
                                                                                             monkeypatch):
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    free, arena = _auto_arena(monkeypatch, slack(bf["all_resident"], flux), lambda free: free // 50)
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    first_budget = hf.engine.budget

    def fail(module, args):
        raise ValueError("refused by the test")

    h = flux.transformer_blocks[-1].register_forward_pre_hook(fail)
    with torch.no_grad(), pytest.raises(ValueError, match="refused by the test"):
        flux(**x)
    h.remove()
    assert "transformer" not in arena.auto.activations and hf.engine.budget == first_budget
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)  # the first clean call measures; then the re-plan
    assert hf.engine.budget > 1.5 * first_budget
    hf.remove()
    arena.close()


def test_an_auto_arena_member_out_of_memory_at_its_smallest_plan_says_so(flux, vae, monkeypatch):
    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    free, arena = _auto_arena(monkeypatch, slack(bf["all_resident"], flux), lambda free: free // 50)
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    h = vae.decoder.mid_block.register_forward_pre_hook(out_of_memory)
    notes = []
    for _ in range(2):
        with torch.no_grad(), pytest.raises(torch.OutOfMemoryError) as info:
            vae.decode(lat)
        notes.append("\n".join(info.value.__notes__))
    assert "call it again" in notes[0] and "ran out of device memory at its smallest plan" in notes[1]
    h.remove()
    with torch.no_grad():
        assert torch.equal(vae.decode(lat).sample, dec)  # memory freed: the offload works, and measures
    assert "vae" in arena.auto.activations
    hv.remove()
    arena.close()


@pytest.mark.parametrize("second", ["vae", "streamed"])
def test_an_auto_arena_member_replans_beside_a_denoiser_larger_than_its_phase(flux, vae, monkeypatch, second):
    """The H200 run of 78c66cf: on a 16 GiB card the transformer re-planned with its phase (free less
    small activations), then the VAE's first call measured a phase smaller than the transformer's working
    set but larger than the VAE's first plan: its re-plan was refused ("cannot hold transformer's working
    set") and so was the fallback, inside the pipeline's call. A member's working set has to fit its own
    phase, not the phase in force (``streamed``: a second member that streams at the first budget and is
    planned again), and a member with nothing streamed is not planned again (``vae``)."""
    from ddo_blocks.tiny import tiny_flux_transformer

    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    free = 21 * slack(bf["all_resident"], flux) // 20  # the denoiser's phase holds it whole
    headroom = 0
    if second == "vae":
        other = vae

        def call():
            return vae.decode(lat).sample

        want = dec
    else:  # a second transformer, streamed at the first budget (half the free memory)
        other = tiny_flux_transformer(seed=1)
        from ddo_blocks.units import span_nbytes, split_units

        headroom = 2 * sum(span_nbytes(p) for _, p in split_units(flux)[1])  # the late joiner's fixed bytes
        free += 2 * headroom
        y = flux_inputs(other, seed=2)

        def call():
            return other(**y)[0]

        with torch.no_grad():
            want = call()
    acts = {"transformer": free // 50, "other": free * (3 if second == "vae" else 55) // (10 if second == "vae" else 100)}
    owner: list[str] = []
    _fake_auto(monkeypatch, free, lambda: acts[owner[-1]])
    arena = Arena("auto", headroom=headroom, _backend=HostChunks(CHUNK, free))
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    ho = ddo_blocks.offload(other, route="vmm", arena=arena, device="cpu", component="other")
    assert bool(ho.engine.streamed) == (second == "streamed")
    first_other = ho.engine.budget
    owner.append("transformer")
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    mf = next(m for m in arena.members if m.name == "transformer")
    assert mf.working_chunks() * CHUNK > free - acts["other"]  # larger than the other's phase
    owner.append("other")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(call(), want)
    assert ho.engine.attached and hf.engine.attached
    assert (ho.engine.budget != first_other) == (second == "streamed")  # planned again with its phase
    assert arena.mapped_chunks() * CHUNK + arena.fixed_bytes <= arena.budget
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
        assert torch.equal(call(), want)
    ho.remove()
    hf.remove()
    arena.close()


def test_a_failed_replan_on_the_auto_arena_attaches_the_first_budget_again(flux, vae, monkeypatch):
    from ddo_blocks import routes

    x, ref, lat, dec, bf, bv = _pair(flux, vae)
    free, arena = _auto_arena(monkeypatch, slack(bf["all_resident"], flux), lambda free: free // 50)
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    first = hf.engine.budget
    spec = routes.get("vmm")
    real = spec.factory
    calls = []

    def failing_once(req):
        chosen, engine = real(req)
        calls.append(req.budget)
        if len(calls) == 1:
            def refuse():
                raise ddo_blocks.BudgetError("no room (test)")

            engine.attach = refuse
        return chosen, engine

    import dataclasses

    monkeypatch.setattr(hf, "_rebuild", (dataclasses.replace(spec, factory=failing_once), hf._rebuild[1]))
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)  # the re-plan failed after this call; the first budget again
    assert calls == [None, first] and hf.engine.attached and hf.engine.budget == first
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    hf.remove()
    arena.close()


def test_a_root_module_that_is_a_streamed_unit_gives_its_lock_back():
    import threading

    from ddo_blocks.streaming.scheduler import Scheduler
    from ddo_blocks.units import Unit

    class Quiet:
        def __getattr__(self, name):
            return lambda *a, **k: 0

    m = torch.nn.Linear(8, 8)
    sched = Scheduler(m, torch.device("cpu"), [Unit(0, "", m, list(m.named_parameters()))], [], Quiet())
    sched.install()
    sched.start(1)
    with torch.no_grad():
        m(torch.randn(1, 8))
    assert sched._solo is None and sched._owner is None and not sched.lock._is_owned()
    done = []
    t = threading.Thread(target=lambda: (torch.no_grad()(m)(torch.randn(1, 8)), done.append(1)), daemon=True)
    t.start()
    t.join(5)
    assert done  # another thread's call was not locked out
    sched.uninstall()
