"""What users do to an offloaded model with their own hands, on a real GPU (``streaming/edits.py``):
peft's LoRA lifecycle after the offload on every streaming route (the adapters' device copies,
fuse and unfuse computed on the host where the parked weights are), in-place edits, GGUF weights
streamed as bytes and torchao's refused. The reference is the resident model doing the same: its
weights on the CPU while peft edits them (as with ``enable_model_cpu_offload``), on the GPU for
each call. Marked ``gpu``: skipped without CUDA, run by hand on the GPU machine."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from peft import LoraConfig
from torch import nn

import ddo_blocks
from ddo_blocks.errors import ConfigError, OffloadStateError
from ddo_blocks.tiny import flux_inputs

from .test_gpu import medium_flux

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")]

TARGETS = (r".*blocks\.\d+\..*(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|ff\.net\.0\.proj|"
           r"ff\.net\.2|proj_mlp|proj_out)")
"""Every attention and MLP projection of the blocks (a regex: the top-level ``proj_out`` is left out)."""

@pytest.fixture(autouse=True)
def _clean():
    """Every test's device memory back before the next (a later test measures the free memory; peft's
    layers and the models' copies form reference cycles that only the cycle collector frees)."""
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


ROUTES = {
    "linear": {},
    "linear-codec": {"codec": "fixed"},
    "vmm": {"route": "vmm"},
}


def _lora(name: str, dora: bool = False):
    def add(model: nn.Module) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(11 if name == "a" else 12)
            model.add_adapter(LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                                         use_dora=dora), adapter_name=name)

    return add


class Pair:
    """The reference (weights on the CPU between calls, on the GPU for each call) and the offloaded
    model (on the GPU at about a third of its weights), doing the same things."""

    def __init__(self, route: str, budget: str):
        self.ref = medium_flux()
        model = copy.deepcopy(self.ref)
        self.x = flux_inputs(self.ref, height=16, width=16, device="cuda")
        kw = dict(ROUTES[route])
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        bytes_ = ddo_blocks.minimum_budget(model, codec=kw.get("codec", "off")) if budget == "min" else total // 3
        if kw.pop("route", None) == "vmm":
            # the CUDA arena rounds to 2 MiB chunks (64 MiB for this model's units): it holds it whole, its
            # units in the arena with host copies (evicted and restored from them)
            self.arena = ddo_blocks.Arena(total + (256 << 20), "cuda")
            self.handle = ddo_blocks.offload(model, route="vmm", arena=self.arena, device="cuda")
        else:
            self.handle = ddo_blocks.offload(model, device="cuda", vram_budget=bytes_, **kw)
        self.off = model
        self.check("right after the offload")

    def close(self) -> None:
        """Removes the offload and gives the arena's memory back now (not whenever it is collected: a
        later test measures the free memory)."""
        self.handle.remove()
        if getattr(self, "arena", None) is not None:
            self.arena.close()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def reference(self) -> torch.Tensor:
        gpu = copy.deepcopy(self.ref).to("cuda")
        with torch.no_grad():
            out = gpu(**self.x)[0]
        del gpu
        return out

    def check(self, what: str) -> None:
        want = self.reference()
        for call in range(2):
            with torch.no_grad():
                got = self.off(**self.x)[0]
            assert torch.equal(got, want), f"{what}: call {call} differs by {(got - want).abs().max()}"

    def both(self, what: str, fn) -> None:
        fn(self.ref)
        fn(self.off)
        self.check(what)


@pytest.mark.parametrize("budget", ["min", "third"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_the_lora_lifecycle_on_the_gpu_is_exact(route, budget):
    """At the smallest plan every block streams: peft fuses on the host, where both models' block
    weights are between calls. With resident blocks (a third of the weights) a fuse would compute
    those on the GPU and the others on the host: fusing is tried at the smallest plan only."""
    pair = Pair(route, budget)
    pair.both("LoRA 'a'", _lora("a"))
    pair.both("LoRA 'b'", _lora("b"))
    edits = pair.handle.report()["edits"]
    if route != "vmm":  # the arena holds this model whole: its adapters sit on the GPU beside their base
        assert edits["adapter_device_copies"] == edits["adapters"] > 0
    pair.both("strengths", lambda m: m.set_adapters(["a", "b"], weights=[0.9, 0.3]))
    moved = pair.handle.report()["runtime"]["h2d_total_bytes"]
    pair.both("'b' alone", lambda m: m.set_adapters("b"))
    if route == "linear" and budget == "min":
        pair.both("fused", lambda m: m.fuse_lora(lora_scale=0.7))
        pair.both("unfused", lambda m: m.unfuse_lora())
    elif route == "linear-codec":
        with pytest.raises(OffloadStateError, match="placeholder"):
            pair.off.fuse_lora()
        pair.check("after the refused fuse")
    pair.both("'a' deleted", lambda m: m.delete_adapters("a"))
    pair.both("unloaded", lambda m: m.unload_lora())
    assert pair.handle.report()["edits"]["adapters"] == 0
    assert moved > 0 or route == "vmm"
    pair.close()


@pytest.mark.parametrize("route", ["linear", "vmm"])
def test_dora_and_in_place_edits_on_the_gpu_are_exact(route):
    """DoRA's magnitude is computed where the base weight is between calls: on the host for streamed
    units (linear at its smallest plan, as the reference does), on the GPU for the arena's resident ones
    (vmm here): there the reference cannot compute the same bits, and only the edits are compared."""
    pair = Pair(route, "min")
    if route == "linear":
        pair.both("DoRA", _lora("a", dora=True))

    def edit(m: nn.Module) -> None:
        with torch.no_grad():
            for p in m.transformer_blocks.parameters():
                p.mul_(1.01)

    pair.both("in-place edit", edit)
    pair.close()


def test_gguf_streams_and_torchao_is_refused_on_the_gpu():
    from gguf import GGMLQuantizationType

    from .test_formats import GGUFStack, _torchao_int8

    model = GGUFStack(GGMLQuantizationType.Q8_0)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to("cuda")
    ref_model = GGUFStack(GGMLQuantizationType.Q8_0).to("cuda")  # the same seed (GGUFParameter has no deepcopy)
    with torch.no_grad():
        ref = ref_model(x)
    del ref_model
    handle = ddo_blocks.offload(model, device="cuda", vram_budget="min")
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(model(x), ref)
    handle.remove()
    flux = medium_flux()
    _torchao_int8(flux)
    with pytest.raises(ConfigError, match="torchao"):
        ddo_blocks.offload(flux, device="cuda", vram_budget="min")
