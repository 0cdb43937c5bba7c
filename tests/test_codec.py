"""The lossless codecs (``codec="fixed"``, ``"tiered"`` and ``"huffman"`` on the linear route) on the CPU engine: outputs
bit-identical to the resident run at every budget, weights restored bit for bit with their strides,
the report's codec figures, the edge values the code must carry, and bad input refused with the
module untouched. The codes' bit-level round trips are Rust tests (``ddo-core``'s ``codec`` and
``tiered``)."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks import _native, routes
from ddo_blocks.streaming import coded, plan
from ddo_blocks.streaming.edits import get_data
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

from .helpers import assert_restored, budgets, snapshot

CODED = ["fixed", "tiered", "huffman"]
RATIO = {"fixed": (0.70, 0.80), "tiered": (0.62, 0.72), "huffman": (0.60, 0.70)}


def bf16_flux(**kw):
    """About 4 MiB of bf16 weights, most tensors large enough to be coded."""
    cfg = dict(num_attention_heads=4, attention_head_dim=32, joint_attention_dim=64, axes_dims_rope=(4, 14, 14))
    return tiny_flux_transformer(torch.bfloat16, **{**cfg, **kw})


def _ref(model, x):
    with torch.no_grad():
        return model(**x)[0]


@pytest.mark.parametrize("codec", CODED)
@pytest.mark.parametrize("budget_name", ["all_streamed", "half", "all_resident"])
def test_coded_forward_is_exact_at_every_budget_and_remove_restores(budget_name, codec):
    model = bf16_flux()
    x = flux_inputs(model)
    ref = _ref(model, x)
    snap = snapshot(model)
    budget = budgets(model)[budget_name]
    handle = ddo_blocks.offload(model, vram_budget=budget, device="cpu", codec=codec)
    with torch.no_grad():
        outs = [model(**x)[0] for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    report = handle.report()
    c = report["codec"]
    if report["plan"]["streamed_units"]:
        assert c["codec"] == codec and c["coded_units"] == report["plan"]["streamed_units"]
        assert c["raw_bytes"] == sum(p.numel() * 2 for u in handle.engine.streamed for _, p in u.params)
        lo, hi = RATIO[codec]
        assert lo < c["ratio"] < hi, c
        # what one call sends over the link is the coded size, not the weights'
        assert report["runtime"]["h2d_call_bytes"] == c["link_call_bytes"] == c["host_bytes"]
    handle.remove()
    assert_restored(model, snap)


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "a_buffer_each"])
def test_coded_buffers_share_one_host_reservation_or_fall_back_to_one_each(monkeypatch, arena):
    """The units' coded buffers are page-aligned slices of one reservation, given back unit by unit
    on remove(); where the host refuses it, each unit gets a buffer of its own, with the same bytes."""
    if not arena:
        monkeypatch.setattr(coded._HostArena, "reserve", classmethod(lambda cls, capacities: None))
    model = bf16_flux()
    x = flux_inputs(model)
    ref = _ref(model, x)
    snap = snapshot(model)
    handle = ddo_blocks.offload(model, vram_budget="min", device="cpu", codec="fixed")
    store = handle.engine.store
    assert (store.arena is not None) == arena
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    ptrs = [buf.data_ptr() for _, buf in store.buffers]
    assert len(ptrs) == len(handle.engine.streamed) > 1 and all(p % 4096 == 0 for p in ptrs)
    if arena:
        base = store.arena.storage.data_ptr()
        spans = sorted((p - base, buf.numel()) for p, (_, buf) in zip(ptrs, store.buffers))
        assert all(a >= 0 and a + n <= b for (a, n), (b, _) in zip(spans, spans[1:] + [(len(store.arena.map), 0)]))
    handle.remove()
    assert store.arena is None and store.buffers == []
    assert_restored(model, snap)


def test_minimum_budget_with_the_codec_runs_and_between_calls_weights_are_placeholders():
    model = bf16_flux()
    x = flux_inputs(model)
    ref = _ref(model, x)
    need = ddo_blocks.minimum_budget(model, codec="fixed", device="cpu")
    handle = ddo_blocks.offload(model, vram_budget="min", device="cpu", codec="fixed")
    assert handle.vram_budget == need
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    streamed = handle.engine.streamed[0].params[0][1]
    # the host holds coded bytes only: the parameter is a one-element placeholder of its shape
    assert get_data(streamed).untyped_storage().nbytes() <= 2
    with pytest.raises(ddo_blocks.OffloadStateError, match="placeholder"):  # never read as if it were the weight
        torch.isnan(streamed)
    handle.remove()
    assert not torch.isnan(streamed).any()


@pytest.mark.parametrize("codec", CODED)
def test_edge_values_strides_and_mixed_dtypes_come_back_exact(codec):
    model = bf16_flux()
    blocks = model.transformer_blocks
    with torch.no_grad():
        w = blocks[0].attn.to_q.weight
        flat = w.view(-1)
        flat[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-39, 3e38])
        flat[100:612] = 1e-30  # a whole block far below its neighbours: escapes
        flat[5000] = 1e30
        # NaN payloads that a float round trip would not keep
        flat.view(torch.int16)[20:24] = torch.tensor([0x7FC1, 0x7F81, -0x3F, -1], dtype=torch.int16)
    # a transposed weight and an fp32 one in the same unit
    blocks[0].attn.to_k.weight = torch.nn.Parameter(blocks[0].attn.to_k.weight.detach().t().contiguous().t())
    blocks[0].attn.register_parameter("extra_fp32", torch.nn.Parameter(torch.randn(5001)))  # sent raw
    blocks[0].attn.register_parameter("extra_odd", torch.nn.Parameter(torch.randn(4097).to(torch.bfloat16)))
    assert not blocks[0].attn.to_k.weight.is_contiguous()
    x = flux_inputs(model)
    with torch.no_grad():
        ref = model(**x)[0]
    bits = {n: p.detach().clone().view(torch.uint8) if p.is_contiguous() else p.detach().clone()
            for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    handle = ddo_blocks.offload(model, vram_budget="min", device="cpu", codec=codec, units="block")
    assert handle.report()["codec"]["escapes"] >= (0 if codec == "huffman" else 512)  # huffman has none
    with torch.no_grad():
        out = model(**x)[0]
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    handle.remove()
    assert all(p is params[n] for n, p in model.named_parameters())  # same objects; values: as bits below
    for n, p in model.named_parameters():
        got = p.detach().view(torch.uint8) if p.is_contiguous() else p.detach()
        assert torch.equal(got, bits[n]), n  # bit for bit, NaN payloads included
    assert blocks[0].attn.to_k.weight.stride() == (1, blocks[0].attn.to_k.weight.shape[0])


def test_a_failed_attach_gives_back_the_units_already_coded(monkeypatch):
    model = bf16_flux()
    x = flux_inputs(model)
    ref = _ref(model, x)
    snap = snapshot(model)
    real = _native.codec_encode_unit_fused
    calls = []

    def encode_then_fail(*args):
        calls.append(1)
        if len(calls) == 3:
            raise ddo_blocks.OffloadMemoryError("refused by the test")
        return real(*args)

    monkeypatch.setattr(coded._native, "codec_encode_unit_fused", encode_then_fail)
    with pytest.raises(ddo_blocks.OffloadMemoryError, match="refused by the test"):
        ddo_blocks.offload(model, vram_budget="min", device="cpu", codec="fixed", units="block")
    assert ddo_blocks.get_handle(model) is None
    assert_restored(model, snap)
    assert torch.equal(_ref(model, x), ref)


def test_bad_codec_requests_are_clear_errors_and_leave_the_module_usable():
    model = bf16_flux()
    x = flux_inputs(model)
    ref = _ref(model, x)
    snap = snapshot(model)
    with pytest.raises(ddo_blocks.ConfigError, match="codec='zstd' is not a codec of route='linear'; use one of 'off', 'fixed'"):
        ddo_blocks.offload(model, vram_budget="min", device="cpu", codec="zstd")
    for preset in ("low_ram_safe", "wsl_compat", "warm_process"):
        with pytest.raises(ddo_blocks.ConfigError, match=f"preset {preset!r}.*one_shot_fast"):
            ddo_blocks.offload(model, preset=preset, vram_budget="min", device="cpu", codec="fixed")
    with pytest.raises(ddo_blocks.ConfigError, match="codec"):
        ddo_blocks.offload(model, route="resident", device="cpu", codec="fixed")
    with pytest.raises(ddo_blocks.ConfigError, match="not a codec"):
        ddo_blocks.minimum_budget(model, codec="lz4")
    coded_min, plain_min = ddo_blocks.minimum_budget(model, codec="fixed"), ddo_blocks.minimum_budget(model)
    assert coded_min == plain_min + coded.reserve_bytes(model, "fixed", torch.device("cuda")) > plain_min
    preset = routes.get("linear").preset_map["one_shot_fast"]
    with pytest.raises(ddo_blocks.BudgetError, match="after the .* of landing buffers the codec needs"):
        # the landing buffers fit, the plan's own minimum then does not
        plan.choose(model, coded_min - plain_min + plain_min // 2, torch.device("cpu"), 1e10, preset, "auto",
                    reserve=coded_min - plain_min)
    with pytest.raises(ddo_blocks.BudgetError, match="does not even hold"):
        plan.choose(model, 1000, torch.device("cpu"), 1e10, preset, "auto", reserve=4096)
    assert ddo_blocks.get_handle(model) is None
    assert_restored(model, snap)
    assert torch.equal(_ref(model, x), ref)


def test_a_model_without_bf16_weights_streams_raw_through_the_coded_store():
    model = tiny_flux_transformer()  # float32
    x = flux_inputs(model)
    ref = _ref(model, x)
    handle = ddo_blocks.offload(model, vram_budget="min", device="cpu", codec="fixed")
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    c = handle.report()["codec"]
    assert c["coded_bytes"] == 0 and c["escapes"] == 0 and c["ratio"] >= 1.0
    handle.remove()


def test_landing_buffers_are_sized_for_the_largest_chunk():
    model = bf16_flux()
    largest = max(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    lb = coded.landing_bytes(model)
    assert lb % 256 == 0 and 1.5 * largest < lb < 1.7 * largest
    assert coded.reserve_bytes(model, "fixed", torch.device("cuda")) == coded.landing_count(model, "fixed") * lb
    assert coded.reserve_bytes(model, "fixed", torch.device("cpu")) == 0
    assert coded.reserve_bytes(model, "off", torch.device("cuda")) == 0
    assert coded.landing_bytes(tiny_flux_transformer()) == 0  # nothing in bf16


def test_from_pretrained_codes_the_weights_straight_from_the_files(tmp_path):
    from diffusers import FluxTransformer2DModel

    model = bf16_flux()
    model.save_pretrained(tmp_path / "m")
    x = flux_inputs(model)
    ref = _ref(model, x)
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, tmp_path / "m", vram_budget="min", device="cpu",
                                        codec="fixed", progress=False)
    with torch.no_grad():
        assert torch.equal(handle.module(**x)[0], ref)
    c = handle.report()["codec"]
    assert c["coded_bytes"] > 0 and c["ratio"] < 0.8
    handle.remove()
    for (n, p), (_, q) in zip(handle.module.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), n


def test_offload_pipeline_and_the_cli_take_the_codec(tmp_path):
    import subprocess
    import sys

    from diffusers import FluxPipeline

    from ddo_blocks.tiny_pipeline import ensure_tiny_model, load_components

    pipe = FluxPipeline(**load_components(ensure_tiny_model("flux")))

    def image():
        with torch.no_grad():
            return pipe("a cat", num_inference_steps=2, height=32, width=32, output_type="pt",
                        generator=torch.Generator().manual_seed(0)).images

    ref = image()
    with ddo_blocks.offload_pipeline(pipe, device="cpu", transformer={"vram_budget": "min", "codec": "fixed"}) as off:
        assert torch.equal(image(), ref)
        assert off.report()["transformer"]["codec"]["codec"] == "fixed"
    out = subprocess.run([sys.executable, "-m", "ddo_blocks", "run", "--device", "cpu", "--denoise-codec", "fixed",
                          "--denoise-budget", "min", "--out", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "output equals the same pipeline without offloading: yes" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ddo_blocks", "run", "--device", "cpu", "--denoise-codec", "zstd"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'zstd'" in bad.stderr


def test_two_threads_calling_a_coded_module_get_exact_outputs():
    import threading

    model = bf16_flux()
    x = flux_inputs(model)
    ref = _ref(model, x)
    handle = ddo_blocks.offload(model, vram_budget="min", device="cpu", codec="fixed")
    results: list[bool] = []

    def work():
        for _ in range(5):
            results.append(torch.equal(_ref(model, x), ref))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 10
    handle.remove()
