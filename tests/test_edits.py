"""What users do to an offloaded model with their own hands, on the CPU engine: peft's LoRA lifecycle
(added before or after the offload, several adapters, strengths, fuse and unfuse, delete, unload,
DoRA), in-place edits of the weights (``.data`` writes, in-place operations, ``load_state_dict``) and
assignments, each compared with the resident model doing the same (``torch.equal``), on every route
that streams on the CPU; or, where the weights are not in host memory between calls (a codec, the
NVMe route's disk units), refused with ``OffloadStateError`` before anything changed, the model still
exact afterwards. ``ddo_blocks.streaming.edits`` says what the contract is."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from diffusers import FluxTransformer2DModel
from peft import LoraConfig
from torch import nn

import ddo_blocks
from ddo_blocks.errors import OffloadStateError
from ddo_blocks.streaming.arena import Arena, HostChunks
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

pytestmark = pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out", "ff.net.2"]

ROUTES = ["linear", "linear-half", "vmm", "codec", "nvme"]
"""Every route that streams on the CPU engine (``linear-half``: resident and streamed units both)."""

HOLDS_VALUES = {"linear", "linear-half", "vmm"}
"""Routes whose streamed weights are in host memory between calls (edits are seen, not refused)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("edits") / "flux"
    tiny_flux_transformer().save_pretrained(path)
    return path


def _offload(route: str, model: nn.Module, checkpoint) -> tuple[nn.Module, ddo_blocks.OffloadHandle]:
    if route == "nvme":
        handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, checkpoint, route="nvme", ram_budget=0,
                                            device="cpu", progress=False, units="block", vram_budget="min")
        return handle.module, handle
    if route == "vmm":
        budget = 1 << 24
        arena = Arena(budget, _backend=HostChunks(4096, budget))
        return model, ddo_blocks.offload(model, route="vmm", arena=arena, device="cpu", vram_budget=ddo_blocks.
                                         minimum_budget(model) + (64 << 10))
    if route == "linear-half":
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        return model, ddo_blocks.offload(model, device="cpu", vram_budget=total // 2)
    kw = {"codec": "fixed"} if route == "codec" else {}
    return model, ddo_blocks.offload(model, device="cpu", vram_budget="min", **kw)


def _run(model: nn.Module, x: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**x)[0]


class Pair:
    """The resident model and the offloaded one, built alike; ``both(fn)`` does the same to each and
    checks the outputs of two calls in a row (the second starts from units prefetched by the first)."""

    def __init__(self, route: str, checkpoint, before=None):
        self.ref = tiny_flux_transformer()
        model = tiny_flux_transformer()
        if before is not None:
            before(self.ref)
            before(model)
        self.x = flux_inputs(self.ref)
        self.off, self.handle = _offload(route, model, checkpoint)
        self.check("right after the offload")

    def check(self, what: str) -> None:
        want = _run(self.ref, self.x)
        for call in range(2):
            got = _run(self.off, self.x)
            assert torch.equal(got, want), f"{what}: call {call} differs by {(got - want).abs().max()}"

    def both(self, what: str, fn) -> None:
        fn(self.ref)
        fn(self.off)
        self.check(what)


def _lora(name: str = "a", dora: bool = False, rank: int = 4):
    def add(model: nn.Module) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7 if name == "a" else 8)
            model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False,
                                         use_dora=dora), adapter_name=name)

    return add


@pytest.mark.parametrize("route", ROUTES)
def test_the_lora_lifecycle_after_offload_is_exact(route, checkpoint, mirrored):
    pair = Pair(route, checkpoint)
    pair.both("LoRA 'a' added after the offload", _lora("a"))
    pair.both("LoRA 'b' added", _lora("b"))
    edits = pair.handle.report()["edits"]
    assert edits["adapters"] > 0 and (edits["adapter_device_copies"] == edits["adapters"]) == mirrored
    pair.both("both, with strengths", lambda m: m.set_adapters(["a", "b"], weights=[1.0, 0.4]))
    pair.both("'b' alone", lambda m: m.set_adapters("b"))
    pair.both("adapters disabled", lambda m: m.disable_adapters())
    pair.both("adapters enabled", lambda m: m.enable_adapters())
    pair.both("'a' and 'b' again", lambda m: m.set_adapters(["a", "b"], weights=[0.7, 0.2]))
    if route in HOLDS_VALUES:
        pair.both("fused", lambda m: m.fuse_lora(lora_scale=0.8))
        pair.both("unfused", lambda m: m.unfuse_lora())
        pair.both("fused safely", lambda m: m.fuse_lora(safe_fusing=True))
        pair.both("unfused again", lambda m: m.unfuse_lora())
    else:
        with pytest.raises(OffloadStateError, match="placeholder stands in its place"):
            pair.off.fuse_lora()
        pair.check("after the refused fuse")
    pair.both("'b' deleted", lambda m: m.delete_adapters("b"))
    pair.both("LoRA unloaded", lambda m: m.unload_lora())
    assert pair.handle.report()["edits"]["adapters"] == 0  # gone with the layers that held them
    pair.handle.remove()
    assert all(type(p) is nn.Parameter for p in pair.off.parameters())
    pair.check("after remove()")


@pytest.mark.parametrize("route", ROUTES)
def test_a_lora_loaded_before_the_offload_fuses_and_unloads_exactly(route, checkpoint):
    if route == "nvme":
        pytest.skip("from_pretrained builds the model: a LoRA comes after it")
    pair = Pair(route, checkpoint, before=_lora("a"))
    if route in HOLDS_VALUES:
        pair.both("fused", lambda m: m.fuse_lora())
        pair.both("unfused", lambda m: m.unfuse_lora())
    else:
        with pytest.raises(OffloadStateError):
            pair.off.fuse_lora()
        pair.check("after the refused fuse")
    pair.both("a strength", lambda m: m.set_adapters("a", weights=0.3))
    # with child units the LoRA layer itself is a unit: after the unload its base layer runs in its place
    pair.both("unloaded", lambda m: m.unload_lora())
    pair.handle.remove()
    pair.check("after remove()")


@pytest.mark.parametrize("route", ROUTES)
def test_dora_after_the_offload_is_exact_or_refused(route, checkpoint):
    pair = Pair(route, checkpoint)
    if route in HOLDS_VALUES:
        pair.both("DoRA added after the offload", _lora("a", dora=True))
    else:  # DoRA's magnitude is computed from the base weight, which is a placeholder between calls
        with pytest.raises(OffloadStateError, match="outside its unit's call"):
            _lora("a", dora=True)(pair.off)
        pair.off.delete_adapters("a")
        pair.check("after the refused DoRA")
    pair.handle.remove()


def _scale_all(model: nn.Module) -> None:
    for p in model.parameters():
        p.data.mul_(1.01)


def _add_no_grad(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def _load_state(model: nn.Module) -> None:
    model.load_state_dict(tiny_flux_transformer(seed=5).state_dict())


def _assign(model: nn.Module) -> None:
    for p in model.parameters():
        p.data = p.data * 0.5 + 0.25


def _augmented(model: nn.Module) -> None:
    for p in model.parameters():
        p.data += 0.125


EDITS = {"data_in_place": _scale_all, "in_place_op": _add_no_grad, "load_state_dict": _load_state,
         "data_assigned": _assign, "data_augmented": _augmented}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("route", ["linear", "linear-half", "vmm"])
def test_in_place_edits_between_calls_are_seen(route, edit, checkpoint):
    pair = Pair(route, checkpoint)
    pair.both(edit, EDITS[edit])
    pair.both(f"{edit} again", EDITS[edit])
    report = pair.handle.report()
    assert report["edits"]["settled"] > 0
    pair.handle.remove()
    pair.check("after remove(): the edits stay")


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("route", ["codec", "nvme"])
def test_edits_of_weights_that_are_not_in_host_memory_are_refused(route, edit, checkpoint):
    pair = Pair(route, checkpoint)
    with pytest.raises((OffloadStateError, RuntimeError), match="placeholder stands in its place"):
        EDITS[edit](pair.off)
    # the loops and load_state_dict stop at the first streamed weight; what came before (resident weights)
    # is edited: the offloaded model computes with exactly the weights it has, as remove() gives them back
    got = _run(pair.off, pair.x)
    pair.handle.remove()
    assert all(type(p) is nn.Parameter for p in pair.off.parameters())
    assert torch.equal(_run(pair.off, pair.x), got)


def test_a_placeholder_never_reaches_user_code(checkpoint):
    pair = Pair("codec", checkpoint)
    p = pair.off.transformer_blocks[0].attn.to_q.weight
    assert p.shape == (32, 32) and p.dtype == torch.float32 and p.device.type == "cpu"
    assert "offloaded by ddo_blocks" in repr(p)
    assert p.data.shape == (32, 32) and p.data.dtype == torch.float32  # diffusers reads these through .data
    for read in (lambda: p.data.sum(), lambda: p + 1, lambda: p.sum(), lambda: p.to("cpu"), lambda: p.clone(),
                 lambda: torch.nn.functional.linear(torch.zeros(1, 32), p), lambda: p.T, lambda: p.mT.T,
                 lambda: p.untyped_storage(), lambda: copy.deepcopy(p), lambda: pickle.dumps(p)):
        with pytest.raises(OffloadStateError, match="to_q.weight"):
            read()
    pair.check("after the refused reads")
    detached = pair.off.state_dict()["transformer_blocks.0.attn.to_q.weight"]  # keys and shapes answer
    assert detached.shape == (32, 32)
    with pytest.raises(OffloadStateError, match="to_q.weight"):
        detached.sum()
    pair.handle.remove()
    assert type(p) is nn.Parameter and torch.isfinite(p).all()


def test_assignments_that_change_the_layout_are_refused(checkpoint):
    pair = Pair("linear", checkpoint)
    lin = pair.off.transformer_blocks[0].attn.to_q
    with pytest.raises(OffloadStateError, match="was assigned"):
        lin.weight.data = torch.zeros(3, 3)
    with pytest.raises(OffloadStateError, match="was assigned"):
        lin.weight.data = lin.weight.data.to(torch.float16)
    pair.check("after the refused assignments")
    lin.weight = nn.Parameter(torch.zeros_like(lin.weight))
    with pytest.raises(OffloadStateError, match="replaced by a new parameter"):
        _run(pair.off, pair.x)
    pair.handle.remove()


def test_calls_without_edits_fetch_nothing_again(checkpoint):
    pair = Pair("linear", checkpoint)
    for _ in range(3):
        _run(pair.off, pair.x)
    section = pair.handle.report()["edits"]
    assert section == {"settled": 0, "adapters": 0, "adapter_bytes": 0, "adapter_device_copies": 0}
    pair.handle.remove()


@pytest.fixture(params=[False, True], ids=["host-adapters", "device-copies"])
def mirrored(request, monkeypatch):
    """``device-copies``: adapters get a device copy their unit points them at while it runs, as on a
    GPU (here a second host copy), so the GPU's adapter path runs on the CPU engine."""
    from ddo_blocks.streaming import engine

    monkeypatch.setattr(engine, "MIRROR_ON_CPU", request.param)
    return request.param


def _lora_state(rank: int, seed: int) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    m = tiny_flux_transformer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False),
                      adapter_name="x")
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(m, adapter_name="x").items()}


@pytest.mark.parametrize("route", ["linear", "linear-half", "vmm", "codec"])
def test_adapters_loaded_and_hot_swapped_after_the_offload_are_exact(route, checkpoint, mirrored):
    """diffusers' ``load_lora_adapter`` after the offload, then hot-swapped in place by one of the same
    rank (values copied into the adapter's tensors) and by one of a larger rank (peft swaps the tensors
    themselves, ``torch.utils.swap_tensors``): each call computes with the adapter loaded last."""
    states = {"first": _lora_state(4, 1), "same": _lora_state(4, 2), "larger": _lora_state(8, 3)}

    def load(which: str, name: str = "a", hotswap: bool = False):
        # each model gets its own copy: peft's hot-swap to a larger rank swaps the state dict's tensors
        # into the model (the dict then holds the old ones)
        return lambda m: m.load_lora_adapter({k: v.clone() for k, v in states[which].items()}, adapter_name=name,
                                             prefix=None, hotswap=hotswap)

    pair = Pair(route, checkpoint)
    pair.both("adapter loaded", load("first"))
    copies = pair.handle.report()["edits"]["adapter_device_copies"]
    assert (copies > 0) == mirrored
    pair.both("hot-swapped, same rank", load("same", hotswap=True))
    pair.both("hot-swapped, larger rank", load("larger", hotswap=True))
    pair.both("a second adapter", load("first", name="b"))
    pair.both("both at strengths", lambda m: m.set_adapters(["a", "b"], weights=[0.5, 1.0]))
    pair.both("unloaded", lambda m: m.unload_lora())
    pair.handle.remove()
    pair.check("after remove()")


def test_arena_resident_edits_survive_an_eviction_and_remove():
    """vmm: a unit the arena keeps resident is edited on the device; another member's call evicts it
    (it points at its host copy), and remove() without a call in between: the edit is kept both ways."""
    from ddo_blocks.tiny import tiny_autoencoder_kl

    from .helpers import budgets
    from .test_vmm import slack

    ref, flux, vae = tiny_flux_transformer(), tiny_flux_transformer(), tiny_autoencoder_kl()
    x = flux_inputs(ref)
    budget = max(slack(budgets(flux)["all_resident"], flux), slack(budgets(vae, "block")["all_resident"], vae)) + (4 << 12)
    arena = Arena(budget, _backend=HostChunks(4096, budget))
    hf = ddo_blocks.offload(flux, route="vmm", arena=arena, device="cpu", component="transformer")
    hv = ddo_blocks.offload(vae, route="vmm", arena=arena, device="cpu", component="vae")
    _run(flux, x)
    for m in (ref, flux):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.5)
    with torch.no_grad():
        vae.decode(torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0)))
    assert arena.report()["evictions"] > 0
    assert torch.equal(_run(flux, x), _run(ref, x))
    for m in (ref, flux):
        m.load_state_dict(tiny_flux_transformer(seed=9).state_dict())
    hv.remove()
    hf.remove()  # no call since the edit
    arena.close()
    assert torch.equal(_run(flux, x), _run(ref, x))


@pytest.mark.parametrize("route", ["linear", "linear-half", "vmm"])
def test_re_pointing_and_aliases_are_seen(route, checkpoint):
    """``p.set_(t)``, an assignment of the same memory seen another way (``w.data = w.data.t()``), and a
    ``.data`` alias taken before a call and edited after it (it shares the parameter's version counter)."""
    pair = Pair(route, checkpoint)

    def set_(m: nn.Module) -> None:
        with torch.no_grad():
            for p in m.transformer_blocks[0].parameters():
                p.set_(p.detach().clone() * 2)

    def transpose(m: nn.Module) -> None:
        for blk in (m.transformer_blocks[1], m.single_transformer_blocks[0]):
            for p in blk.parameters():
                if p.dim() == 2 and p.shape[0] == p.shape[1]:
                    p.data = p.data.t()

    pair.both("set_", set_)
    pair.both("w.data = w.data.t()", transpose)
    aliases = {id(m): [p.data for p in m.parameters()] for m in (pair.ref, pair.off)}
    _run(pair.off, pair.x)  # the next call's first units are fetched again after this one

    def through_alias(m: nn.Module) -> None:
        with torch.no_grad():
            for t in aliases[id(m)]:
                t.add_(0.125)

    pair.both("edited through aliases kept across a call", through_alias)
    pair.handle.remove()
    pair.check("after remove()")


def test_watched_parameters_copy_and_pickle_as_their_own_class(checkpoint):
    import io

    pair = Pair("linear", checkpoint)
    p = pair.off.transformer_blocks[0].attn.to_q.weight
    twin = copy.deepcopy(p)
    assert type(twin) is nn.Parameter and torch.equal(twin, pair.ref.transformer_blocks[0].attn.to_q.weight)
    buf = io.BytesIO()
    torch.save(dict(pair.off.named_parameters()), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert all(type(t) is nn.Parameter for t in loaded.values())
    assert all(torch.equal(loaded[n], r) for n, r in pair.ref.named_parameters())
    pair.check("after the copies")
    pair.handle.remove()


def test_placeholders_inside_lists_and_their_views_refuse_reads(checkpoint):
    """``torch.cat([...])`` of parked weights (diffusers' fuse_qkv_projections does it), ``.data`` of a
    ``.data`` view, a state dict's values stacked: refused, never NaN."""
    pair = Pair("codec", checkpoint)
    attn = pair.off.transformer_blocks[0].attn
    sd = pair.off.state_dict()
    for read in (lambda: torch.cat([attn.to_q.weight.data, attn.to_k.weight.data]),
                 lambda: torch.stack([sd["transformer_blocks.0.attn.to_q.weight"]]),
                 lambda: attn.to_q.weight.data.data.sum(), lambda: sd["transformer_blocks.0.attn.to_q.weight"].data + 1,
                 lambda: torch._foreach_norm(list(attn.to_q.parameters()))):
        with pytest.raises(OffloadStateError, match="placeholder"):
            read()
    pair.check("after the refused reads")
    pair.handle.remove()


def test_a_refused_edit_does_not_hide_another(checkpoint):
    """One unit's parameter pointed at another layout (refused) and another unit's weights edited in
    place: the refusal comes, and the in-place edit is in every call after it."""
    pair = Pair("linear", checkpoint)
    first = pair.handle.engine.streamed[0].params[0][1]
    with torch.no_grad():
        first.set_(torch.zeros(first.shape[0] + 1, *first.shape[1:]))
        for m in (pair.ref, pair.off):
            for p in m.single_transformer_blocks[2].parameters():
                p.mul_(1.25)
    with pytest.raises(OffloadStateError, match="was pointed at a"):
        _run(pair.off, pair.x)
    name = pair.handle.engine.streamed[0].params[0][0]
    with torch.no_grad():
        first.set_(pair.ref.get_parameter(name).detach().clone())  # the user puts it right
    pair.check("after the refusal")
    pair.handle.remove()


@pytest.mark.parametrize("route", ["linear", "linear-half", "vmm"])
def test_a_re_pointed_weight_is_kept_by_remove_without_a_call(route, checkpoint):
    pair = Pair(route, checkpoint)
    for m in (pair.ref, pair.off):
        with torch.no_grad():
            for p in m.single_transformer_blocks.parameters():
                p.set_(p.detach().clone() * 0.5)
    pair.handle.remove()
    pair.check("after remove()")
