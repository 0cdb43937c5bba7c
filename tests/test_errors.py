"""Every documented bad input: a clear error naming what was wrong and what would work, raised
before any weight moves, leaving the module usable."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks import _native
from ddo_blocks.tiny import flux_inputs

from .conftest import cuda_ready
from .helpers import assert_restored, budgets, snapshot


def _still_usable(module, snap, x, ref):
    assert_restored(module, snap)
    assert getattr(module, "_ddo_offload", None) is None or not module._ddo_offload.removed
    with torch.no_grad():
        assert torch.equal(module(**x)[0], ref)


@pytest.fixture
def flux_state(flux):
    x = flux_inputs(flux)
    with torch.no_grad():
        ref = flux(**x)[0]
    return flux, snapshot(flux), x, ref


def test_unknown_route_lists_valid_routes(flux_state):
    flux, snap, x, ref = flux_state
    with pytest.raises(ddo_blocks.ConfigError, match=r"unknown route 'fast'.*valid routes: linear, .*resident"):
        ddo_blocks.offload(flux, route="fast", device="cpu")
    _still_usable(flux, snap, x, ref)


def test_unknown_preset_lists_valid_presets(flux_state):
    flux, snap, x, ref = flux_state
    with pytest.raises(ddo_blocks.ConfigError) as err:
        ddo_blocks.offload(flux, preset="turbo", device="cpu")
    msg = str(err.value)
    assert "turbo" in msg
    for name in ("auto", "one_shot_fast", "low_ram_safe", "warm_process", "wsl_compat", "off"):
        assert name in msg
    _still_usable(flux, snap, x, ref)


def test_budget_below_largest_unit_names_the_minimum(flux_state):
    flux, snap, x, ref = flux_state
    minimum = budgets(flux, "child")["all_streamed"]  # the lowest minimum over unit granularities
    with pytest.raises(ddo_blocks.BudgetError, match=rf"minimum .*\({minimum} bytes\)") as err:
        ddo_blocks.offload(flux, vram_budget=minimum - 1, device="cpu")
    assert "2 slots" in str(err.value)
    assert isinstance(err.value, ddo_blocks.PlanError) and isinstance(err.value, ddo_blocks.DdoError)
    _still_usable(flux, snap, x, ref)
    handle = ddo_blocks.offload(flux, vram_budget=minimum, device="cpu")  # the named minimum works
    handle.remove()


@pytest.mark.parametrize("bad", ["six gigs", "-1GiB", "6 parsecs", True, [1]])
def test_malformed_budget(flux_state, bad):
    flux, snap, x, ref = flux_state
    with pytest.raises(ddo_blocks.ConfigError, match="vram_budget"):
        ddo_blocks.offload(flux, vram_budget=bad, device="cpu")
    _still_usable(flux, snap, x, ref)


def test_budget_strings():
    assert ddo_blocks.parse_bytes("6GiB") == 6 * 1024**3
    assert ddo_blocks.parse_bytes("1.5 GB") == 1_500_000_000
    assert ddo_blocks.parse_bytes("512MiB") == 512 * 1024**2
    assert ddo_blocks.parse_bytes(123) == 123
    assert ddo_blocks.parse_bytes(None) is None


@pytest.mark.skipif(cuda_ready(), reason="this machine has CUDA")
def test_cuda_without_driver_is_a_clear_error(flux_state):
    flux, snap, x, ref = flux_state
    with pytest.raises(ddo_blocks.CudaNotAvailableError, match="CUDA is not available.*use device=.cpu.$"):
        ddo_blocks.offload(flux, device="cuda")
    assert isinstance(_native.cuda_unavailable_reason(), str)
    with pytest.raises(ddo_blocks.CudaNotAvailableError):
        _native.Transport("cuda", 0, 2)
    _still_usable(flux, snap, x, ref)


def test_unsupported_device(flux_state):
    flux, snap, x, ref = flux_state
    with pytest.raises(ddo_blocks.ConfigError, match="not supported"):
        ddo_blocks.offload(flux, device="meta")
    with pytest.raises(ddo_blocks.ConfigError, match="is not a device"):
        ddo_blocks.offload(flux, device="gpu0")
    _still_usable(flux, snap, x, ref)


def test_module_without_parameters():
    with pytest.raises(ddo_blocks.ConfigError, match="has no parameters"):
        ddo_blocks.offload(torch.nn.ReLU(), device="cpu")


def test_not_a_module():
    with pytest.raises(ddo_blocks.ConfigError, match="needs a torch.nn.Module"):
        ddo_blocks.offload("transformer", device="cpu")


def test_offloading_twice(flux_state):
    flux, snap, x, ref = flux_state
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    with pytest.raises(ddo_blocks.OffloadStateError, match="already offloaded.*remove"):
        ddo_blocks.offload(flux, device="cpu")
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    handle.remove()
    _still_usable(flux, snap, x, ref)


def test_remove_twice(flux_state):
    flux, snap, x, ref = flux_state
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    handle.remove()
    with pytest.raises(ddo_blocks.OffloadStateError, match="already removed"):
        handle.remove()
    _still_usable(flux, snap, x, ref)


def test_unknown_route_option(flux_state):
    flux, snap, x, ref = flux_state
    with pytest.raises(ddo_blocks.ConfigError, match="does not take offload_type; its options are units"):
        ddo_blocks.offload(flux, device="cpu", offload_type="leaf_level")
    _still_usable(flux, snap, x, ref)


def test_failure_during_setup_rolls_back(flux_state, monkeypatch):
    """A failure in the middle of packing (here: injected on the third slab copy) restores the module."""
    flux, snap, x, ref = flux_state
    from ddo_blocks.streaming import slabs as slabs_mod

    calls = {"n": 0}
    real_view = slabs_mod.strided_view

    def flaky_view(base, offset, like):
        calls["n"] += 1
        if calls["n"] == 20:
            raise MemoryError("injected allocation failure")
        return real_view(base, offset, like)

    monkeypatch.setattr(slabs_mod, "strided_view", flaky_view)
    with pytest.raises(MemoryError, match="injected"):
        ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    monkeypatch.undo()
    assert getattr(flux, "_ddo_offload", None) is None
    _still_usable(flux, snap, x, ref)
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    handle.remove()


def test_auto_preset_pins_only_up_to_half_the_ram():
    from ddo_blocks.presets import resolve

    gib = 1 << 30
    assert resolve("linear", "auto", streamed_bytes=20 * gib, total_ram=64 * gib).name in ("one_shot_fast", "wsl_compat")
    assert resolve("linear", "auto", streamed_bytes=20 * gib, total_ram=32 * gib).name in ("low_ram_safe", "wsl_compat")


def test_autograd_through_streamed_weights_is_refused(flux_state):
    """Backward would read weights from reused slots: refused with a clear error, module usable."""
    flux, snap, x, ref = flux_state
    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")
    with pytest.raises(ddo_blocks.OffloadStateError, match=r"torch.no_grad\(\)"):
        flux(**x)
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
    flux.requires_grad_(False)
    assert torch.equal(flux(**x)[0], ref)  # no parameter needs grad: allowed with autograd on
    flux.requires_grad_(True)
    handle.remove()
    _still_usable(flux, snap, x, ref)


def test_a_failure_while_releasing_slabs_still_restores_every_parameter(flux_state, monkeypatch):
    flux, snap, x, ref = flux_state
    from ddo_blocks.streaming import slabs as slabs_mod

    handle = ddo_blocks.offload(flux, vram_budget=budgets(flux)["all_streamed"], device="cpu")

    def broken(self, orig_device, keep_warm):
        raise MemoryError("injected while copying out of the slabs")

    monkeypatch.setattr(slabs_mod.SlabSet, "release", broken)
    with pytest.raises(MemoryError, match="injected"):
        handle.remove()
    monkeypatch.undo()
    assert handle.removed  # detached: the state says so, and the values are still right
    assert all(p.device.type == "cpu" for p in flux.parameters())
    with torch.no_grad():
        assert torch.equal(flux(**x)[0], ref)
