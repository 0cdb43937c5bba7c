"""One host copy for several offloads (``share_weights`` / ``replica``) on the CPU engine: two
offloads of one model's weights, each with its own plan and slots, exact, the second borrowing every
unit the first holds in its slabs; either removed first, the other keeps working; bad requests are
clear errors."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks import ConfigError
from ddo_blocks.streaming import slabs
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

from .helpers import assert_restored, budgets, snapshot


def _run(model, x):
    with torch.no_grad():
        return model(**x)[0]


@pytest.mark.parametrize("first_removed", ["original", "replica"])
def test_a_replica_borrows_the_host_slabs_and_both_stay_exact(first_removed):
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    snap = snapshot(model)
    b = budgets(model)
    h0 = ddo_blocks.offload(model, vram_budget=b["half"], device="cpu")
    twin = ddo_blocks.replica(model)
    assert twin is not model and all(p.device.type == "cpu" for p in twin.parameters())
    h1 = ddo_blocks.offload(twin, vram_budget=b["all_streamed"], device="cpu")
    p0, p1 = h0.report()["plan"], h1.report()["plan"]
    # the replica streams more units than the original; those the original streams are borrowed (no
    # copy), only those it keeps resident got slabs of the replica's own
    assert p1["streamed_units"] > p0["streamed_units"] > 0
    assert p1["host_borrowed_bytes"] > 0 and p0["host_borrowed_bytes"] == 0
    assert p1["host_slab_bytes"] + p1["host_borrowed_bytes"] == p1["streamed_bytes"] > p1["host_slab_bytes"]
    s1 = h1.engine.store.slabs
    both = {u.name for u in h0.engine.streamed}
    assert s1.borrowed_bytes == sum(n for u, n in zip(h1.engine.streamed, s1.unit_nbytes) if u.name in both)
    assert s1.nbytes >= sum(n for u, n in zip(h1.engine.streamed, s1.unit_nbytes) if u.name not in both) > 0
    for _ in range(2):  # interleaved calls, each on its own slots
        assert torch.equal(_run(model, x), ref)
        assert torch.equal(_run(twin, x), ref)
    shared = [s for s in h0.engine.store.slabs.slabs if s.users > 1]
    assert shared and all(s.users == 2 for s in shared)
    first, second = (h0, h1) if first_removed == "original" else (h1, h0)
    first.remove()
    assert all(s.users == 1 for s in shared)
    alive = twin if first_removed == "original" else model
    assert torch.equal(_run(alive, x), ref)
    second.remove()
    assert all(s.users == 0 for s in shared)
    assert not any(id(s) in {id(v) for v in slabs._LIVE.values()} for s in shared)
    assert torch.equal(_run(model, x), ref) and torch.equal(_run(twin, x), ref)  # both plain modules again
    assert_restored(model, snap)


def test_share_weights_refuses_what_it_cannot_share():
    model = tiny_flux_transformer()
    twin = tiny_flux_transformer()
    with pytest.raises(ConfigError, match="is not offloaded by ddo_blocks"):
        ddo_blocks.share_weights(model, twin)
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)["half"], device="cpu")
    other = tiny_flux_transformer(num_layers=1)
    with pytest.raises(ConfigError, match="different parameters"):
        ddo_blocks.share_weights(model, other)
    with pytest.raises(ConfigError, match="another module, not offloaded yet"):
        ddo_blocks.share_weights(model, model)
    with pytest.raises(ConfigError, match="not a diffusers model"):
        ddo_blocks.replica(torch.nn.Linear(2, 2))
    handle.remove()
    coded = ddo_blocks.offload(model, vram_budget="min", device="cpu", codec="fixed")
    with pytest.raises(ConfigError, match="not a\\s+codec"):
        ddo_blocks.share_weights(model, twin)
    coded.remove()


def test_an_offload_dropped_without_remove_leaves_no_live_slab_behind():
    import gc

    model = tiny_flux_transformer()
    handle = ddo_blocks.offload(model, vram_budget=budgets(model)["half"], device="cpu")
    own = {id(s) for s in handle.engine.store.slabs.slabs}
    keys = {k for k, s in slabs._LIVE.items() if id(s) in own}
    assert keys
    del handle, model
    gc.collect()
    assert not keys & set(slabs._LIVE.keys())


def test_replica_refuses_a_model_that_keeps_tensors_outside_parameters_and_buffers():
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class WithTable(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, n: int = 64):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(n, n) for _ in range(4))
            self.table = torch.arange(n, dtype=torch.float32)  # a plain attribute

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x + self.table

    model = WithTable().eval().requires_grad_(False)
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    assert handle.report()["plan"]["streamed_units"] > 0
    with pytest.raises(ConfigError, match=r"keeps tensors outside its parameters and buffers \(table\)"):
        ddo_blocks.replica(model)
    handle.remove()


def _original_and_replica(first_budget: str):
    """A tiny Flux offloaded at ``first_budget`` and its replica at the smallest plan: (model, twin, the
    two handles, inputs, the resident output)."""
    model = tiny_flux_transformer()
    x = flux_inputs(model)
    ref = _run(model, x)
    b = budgets(model)
    h0 = ddo_blocks.offload(model, vram_budget=b[first_budget], device="cpu")
    twin = ddo_blocks.replica(model)
    h1 = ddo_blocks.offload(twin, vram_budget=b["all_streamed"], device="cpu")
    return model, twin, h0, h1, x, ref


def _storages(model) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


@pytest.mark.parametrize("first_removed", ["original", "replica"])
def test_a_removed_offload_owns_its_weights(first_removed):
    """On the CPU engine the original's resident weights are in host memory too: the replica gets a copy
    of them, so once either offload is removed, editing its weights leaves the other's outputs alone,
    and no tensor is shared after both are removed."""
    model, twin, h0, h1, x, ref = _original_and_replica("half")
    gone, gone_h, alive = (model, h0, twin) if first_removed == "original" else (twin, h1, model)
    gone_h.remove()
    with torch.no_grad():
        for p in gone.parameters():
            p.mul_(2.0)
    assert torch.equal(_run(alive, x), ref)
    (h1 if first_removed == "original" else h0).remove()
    assert torch.equal(_run(alive, x), ref)
    assert not _storages(model) & _storages(twin)


def test_an_edit_of_weights_shared_with_a_replica_is_refused_by_both():
    """The replica streams the original's host copies: an edit of one of those through either module
    would change both (and the replica keeps its own copy of the rest), so both refuse their next call."""
    model, twin, h0, h1, x, ref = _original_and_replica("all_streamed")
    for m in (model, twin):
        assert torch.equal(_run(m, x), ref)
    with torch.no_grad():
        h0.engine.streamed[0].params[0][1].mul_(1.5)  # in a host slab the replica borrows
    for m in (twin, model):
        with pytest.raises(ddo_blocks.OffloadStateError, match="shares its host copies"):
            _run(m, x)
    h1.remove()
    h0.remove()
    edited = _run(model, x)
    assert not torch.equal(edited, ref) and torch.equal(_run(model, x), edited)


@pytest.mark.parametrize("removed", ["original", "replica"])
def test_an_edit_pending_when_one_offload_is_removed_is_refused_by_the_other(removed):
    model, twin, h0, h1, x, ref = _original_and_replica("all_streamed")
    for m in (model, twin):
        _run(m, x)
    with torch.no_grad():
        h0.engine.streamed[0].params[0][1].mul_(1.5)  # in a host slab the replica borrows
    gone, other, other_module = (h0, h1, twin) if removed == "original" else (h1, h0, model)
    gone.remove()
    with pytest.raises(ddo_blocks.OffloadStateError, match="which was removed since"):
        _run(other_module, x)
    other.remove()
