"""One host copy of the weights for two offloads on the GPU: on one GPU (two handles side by side,
the second borrowing the first's page-locked slabs) and, where the machine has two, on cuda:0 and
cuda:1 at once. Marked ``gpu``: skipped without CUDA; the two-GPU case also without a second GPU."""

from __future__ import annotations

import threading

import pytest
import torch

import ddo_blocks
from ddo_blocks.tiny import flux_inputs

from .helpers import budgets
from .test_gpu import _resident_reference, medium_flux

pytestmark = pytest.mark.gpu


def _devices(two: bool) -> tuple[str, str]:
    if two and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the nvidia-h200-x2 machine)")
    return ("cuda:0", "cuda:1") if two else ("cuda:0", "cuda:0")


@pytest.mark.parametrize("two", [False, True], ids=["one_gpu", "two_gpus"])
def test_two_offloads_share_one_host_copy_and_run_side_by_side(two):
    d0, d1 = _devices(two)
    model = medium_flux()
    x0 = flux_inputs(model, height=16, width=16, text_len=32, device=d0)
    ref, _ = _resident_reference(model, x0)
    h0 = ddo_blocks.offload(model, vram_budget=budgets(model)["half"], device=d0)
    twin = ddo_blocks.replica(model)
    h1 = ddo_blocks.offload(twin, vram_budget=budgets(model)["half"], device=d1)
    # every unit both stream is borrowed by the replica (not copied, not pinned again); only units
    # the original keeps resident get slabs of the replica's own
    s1 = h1.engine.store.slabs
    both = {u.name for u in h0.engine.streamed}
    shared = sum(n for u, n in zip(h1.engine.streamed, s1.unit_nbytes) if u.name in both)
    assert shared > 0 and s1.borrowed_bytes == shared
    own = sum(n for u, n in zip(h1.engine.streamed, s1.unit_nbytes) if u.name not in both)
    assert (s1.nbytes == 0) == (own == 0) and h1.report()["memory"]["pinned_bytes"] == s1.nbytes
    x1 = {k: v.to(d1) if isinstance(v, torch.Tensor) else v for k, v in x0.items()}
    outs: dict[str, list[torch.Tensor]] = {"0": [], "1": []}

    def run(m, x, key):
        with torch.no_grad():
            for _ in range(3):
                outs[key].append(m(**x)[0].cpu())

    threads = [threading.Thread(target=run, args=(model, x0, "0")), threading.Thread(target=run, args=(twin, x1, "1"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(o, ref.cpu()) for o in outs["0"] + outs["1"])
    h0.remove()
    with torch.no_grad():
        assert torch.equal(twin(**x1)[0].cpu(), ref.cpu())  # the replica keeps working
    h1.remove()


@pytest.mark.parametrize("options", [{"graph": True}, {"codec": "fixed"}, {"vram_budget": "min"}],
                         ids=["graph", "codec", "min"])
@pytest.mark.parametrize("two", [False, True], ids=["one_gpu", "two_gpus"])
def test_a_streamed_offload_on_a_device_that_is_not_the_current_one_is_exact(two, options):
    """The paths the two-device audit of session 17 read (graph capture and replay, the codec's decode
    kernels, the smallest plan's sizing) on cuda:1 while cuda:0 stays the thread's current device:
    every output equals the resident one (computed on cuda:0; the two-GPU machine's GPUs are alike)."""
    d0, dev = _devices(two)
    model = medium_flux()
    x0 = flux_inputs(model, height=16, width=16, text_len=32, device=d0)
    ref, _ = _resident_reference(model, x0)
    x = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in x0.items()}
    assert torch.cuda.current_device() == 0
    handle = ddo_blocks.offload(model, device=dev, **{"vram_budget": budgets(model)["half"], **options})
    with torch.no_grad():
        outs = [model(**x)[0].cpu() for _ in range(8)]
    assert torch.cuda.current_device() == 0 and all(torch.equal(o, ref.cpu()) for o in outs)
    if options.get("graph"):
        g = handle.report()["graph"]
        assert g["capture_failures"] == 0 and g["replays"] > 0, g
    handle.remove()
