"""The SDNQ packed route: SDNQ-quantized models (quantized here by sdnq, a GPL test-only dependency
that the package never imports) stream packed and compute exactly as SDNQ-resident."""

from __future__ import annotations

import warnings

import pytest
import torch

import ddo_blocks
from ddo_blocks import ConfigError
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

from .helpers import assert_restored, cuda_reference, snapshot

sdnq = pytest.importorskip("sdnq")

KINDS = [
    ("int8", {}),
    ("int8", {"use_quantized_matmul": True}),
    ("uint4", {}),
    ("uint4", {"use_svd": True, "svd_rank": 4}),
    ("float8_e4m3fn", {}),
]


def quantized(weights_dtype: str = "int8", **kw):
    model = tiny_flux_transformer(dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sdnq's own notes on missing optional kernels
        return sdnq.sdnq_post_load_quant(model, weights_dtype=weights_dtype, torch_dtype=torch.bfloat16,
                                         minimum_allowed_numel=0, minimum_allowed_channel_size=0, **kw).eval()


def _dtypes(model):
    return {n: (p.dtype, p.stride()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("weights_dtype, kw", KINDS, ids=[f"{d}{'-' + '-'.join(k) if k else ''}" for d, k in KINDS])
def test_packed_layers_stream_exactly(weights_dtype, kw):
    model = quantized(weights_dtype, **kw)
    x = flux_inputs(model)
    with torch.no_grad():
        ref = model(**x)[0]
    snap, packed = snapshot(model), _dtypes(model)
    handle = ddo_blocks.offload(model, route="sdnq", vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    plan = handle.report()["plan"]
    assert plan["streamed_units"] > 0 and plan["sdnq_layers"].startswith(weights_dtype)
    # moved as stored: every tensor keeps its packed dtype and strides (nothing dequantized)
    assert _dtypes(model) == packed
    bf16 = sum(p.numel() * 2 for u in handle.units if u.streamed for p in u.module.parameters())
    assert plan["streamed_bytes"] < bf16
    with torch.no_grad():
        assert all(torch.equal(model(**x)[0], ref) for _ in range(3))
    handle.remove()
    assert_restored(model, snap)
    assert _dtypes(model) == packed


def test_linear_auto_picks_the_sdnq_route_and_plain_models_stay_linear(flux):
    model = quantized()
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    assert handle.route == "sdnq" and handle.preset.name == "sdnq"
    handle.remove()
    plain = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu")
    assert plain.route == "linear"
    plain.remove()


def test_what_the_route_cannot_carry_is_refused_untouched(flux):
    with pytest.raises(ConfigError, match="holds none .* use route='linear'"):
        ddo_blocks.offload(flux, route="sdnq", device="cpu")
    model = quantized()
    layer = model.transformer_blocks[0].attn.to_q
    layer.sdnq_dequantizer.layer_class_name = "Embedding"
    snap = snapshot(model)
    with pytest.raises(ConfigError, match="transformer_blocks.0.attn.to_q is an SDNQ layer of kind 'Embedding'.* "
                                          "carries SDNQ layers of the kinds Linear"):
        ddo_blocks.offload(model, route="sdnq", vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    layer.sdnq_dequantizer.layer_class_name = "Linear"
    layer.cached = torch.zeros(4)  # a tensor streaming would not move
    with pytest.raises(ConfigError, match="holds tensors outside its parameters \\(cached\\)"):
        ddo_blocks.offload(model, route="sdnq", vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    assert ddo_blocks.get_handle(model) is None
    assert_restored(model, snap)


def test_from_pretrained_loads_an_sdnq_checkpoint_with_diffusers_and_streams_it(tmp_path):
    from diffusers import FluxTransformer2DModel

    quantized("uint4").save_pretrained(tmp_path)
    reference = FluxTransformer2DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    x = flux_inputs(reference)
    with torch.no_grad():
        ref = reference(**x)[0]
    budget = ddo_blocks.minimum_budget(reference)
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, tmp_path, vram_budget=budget, device="cpu",
                                        dtype=torch.bfloat16)
    assert handle.route == "sdnq" and handle.report()["plan"]["streamed_units"] > 0
    with torch.no_grad():
        assert all(torch.equal(handle.module(**x)[0], ref) for _ in range(2))
    handle.remove()


def test_the_package_never_imports_sdnq():
    import subprocess
    import sys

    code = ("import sys, ddo_blocks, ddo_blocks.routes.sdnq, ddo_blocks.blocks; "
            "assert 'sdnq' not in sys.modules, 'ddo_blocks imported sdnq'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("weights_dtype, kw", KINDS, ids=[f"{d}{'-' + '-'.join(k) if k else ''}" for d, k in KINDS])
def test_packed_layers_stream_exactly_on_cuda(weights_dtype, kw):
    model = quantized(weights_dtype, **kw)
    x = flux_inputs(model)
    ref, xc = cuda_reference(model, x)
    budget = ddo_blocks.minimum_budget(model)
    handle = ddo_blocks.offload(model, route="sdnq", vram_budget=budget, device="cuda")
    with torch.no_grad():
        outs = [model(**xc)[0] for _ in range(3)]
    assert all(torch.equal(o, ref) for o in outs)
    assert handle.report()["plan"]["gpu_bytes"] <= budget
    handle.remove()


def test_from_pretrained_keeps_the_checkpoint_dtype_when_none_is_given(tmp_path):
    from diffusers import FluxTransformer2DModel

    quantized("uint4").save_pretrained(tmp_path)
    handle = ddo_blocks.from_pretrained(FluxTransformer2DModel, tmp_path, device="cpu")
    packed = {id(p) for _, m in ddo_blocks.routes.sdnq.sdnq_layers(handle.module) for p in m.parameters()}
    plain = {p.dtype for p in handle.module.parameters() if id(p) not in packed}
    assert plain == {torch.bfloat16}, plain  # as saved, not diffusers' float32 default
    handle.remove()


@pytest.mark.parametrize("weights_dtype", ["int8", "uint4"])
def test_the_plan_estimates_compute_from_the_dequantized_weights(weights_dtype):
    # a packed layer computes with its dequantized weight: the planner's compute estimate (before the
    # first call measures it) counts those bytes, not the fewer it streams, so a compute-bound packed
    # model is not planned as if it were transfer-bound
    from ddo_blocks.routes.sdnq import dense_bytes, is_sdnq_layer, unit_compute_bytes
    from ddo_blocks.units import split_units

    dense = tiny_flux_transformer(dtype=torch.bfloat16)
    model = quantized(weights_dtype)
    layers = 0
    for layer, ref in zip(dict(model.named_modules()).values(), dict(dense.named_modules()).values()):
        if is_sdnq_layer(layer):
            layers += 1
            others = sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "weight")
            assert dense_bytes(layer) - others == ref.weight.numel() * ref.weight.element_size()
    assert layers > 0
    units, _ = split_units(model, "block")
    stored = [u.nbytes for u in units]
    estimated = unit_compute_bytes(units)
    assert all(e >= s for e, s in zip(estimated, stored)) and sum(estimated) > 1.5 * sum(stored)
    # the dense model's bytes, plus the scales (and zero points) the packed layers also read
    dense_units, _ = split_units(dense, "block")
    assert all(d <= e <= 1.2 * d for e, d in zip(estimated, (u.nbytes for u in dense_units)))
