"""Quantized weight formats on the streaming routes (CPU engine): diffusers' GGUF parameters (Q8_0 and
Q4_0 written by gguf's quantizer, K-quants Q4_K and Q6_K as blocks of valid scales and random codes)
stream as their bytes and compute exactly; torchao's and optimum-quanto's tensor subclasses are
refused before any weight moves, naming the format, and the module still runs (and offloads resident)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import nn

import ddo_blocks
from ddo_blocks.errors import ConfigError
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

WIDTH = 256  # a K-quant block holds 256 values

_SCALES = {GGMLQuantizationType.Q4_K: [0, 2], GGMLQuantizationType.Q6_K: [208]}
"""Byte offsets of a K-quant block's f16 scales (``d``, ``dmin``), set to sane values."""


def _gguf_bytes(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> torch.Tensor:
    if qtype in _SCALES:
        block, size = GGML_QUANT_SIZES[qtype]
        rows = values.shape[0]
        data = rng.integers(0, 256, size=(rows, values.shape[1] // block * size), dtype=np.uint8)
        view = data.reshape(rows, -1, size)
        for off in _SCALES[qtype]:
            view[:, :, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        return torch.from_numpy(data)
    return torch.from_numpy(quants.quantize(values, qtype))


class GGUFStack(nn.Module):
    """Four blocks of two GGUF linear layers (and a plain bias), the way diffusers loads a GGUF file."""

    def __init__(self, qtype: GGMLQuantizationType, seed: int = 0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.blocks = nn.ModuleList()
        for _ in range(4):
            block = nn.Sequential(GGUFLinear(WIDTH, WIDTH, True, compute_dtype=torch.float32), nn.GELU(),
                                  GGUFLinear(WIDTH, WIDTH, True, compute_dtype=torch.float32))
            for lin in (block[0], block[2]):
                w = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 16
                lin.weight = GGUFParameter(_gguf_bytes(w, qtype, rng), quant_type=qtype)
                lin.bias = nn.Parameter(torch.from_numpy(rng.standard_normal(WIDTH).astype(np.float32)),
                                        requires_grad=False)
            self.blocks.append(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0,
                                   GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("budget", ["min", "half"])
def test_gguf_weights_stream_exactly(qtype, budget):
    model = GGUFStack(qtype)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    assert torch.isfinite(ref).all()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    handle = ddo_blocks.offload(model, device="cpu", vram_budget="min" if budget == "min" else total // 2)
    assert handle.report()["plan"]["streamed_units"] > 0
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(model(x), ref)
    weight = model.blocks[0][0].weight
    assert isinstance(weight, GGUFParameter) and weight.quant_type == qtype
    handle.remove()
    assert type(weight) is GGUFParameter
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def _torchao_int8(model: nn.Module) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())


def _torchao_float8(model: nn.Module) -> None:
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    quantize_(model, Float8WeightOnlyConfig())


def _quanto_int8(model: nn.Module) -> None:
    from optimum.quanto import freeze, qint8, quantize

    quantize(model, weights=qint8)
    freeze(model)


@pytest.mark.parametrize("quantize,family", [(_torchao_int8, "torchao"), (_torchao_float8, "torchao"),
                                             (_quanto_int8, "optimum-quanto")], ids=["torchao-int8", "torchao-float8",
                                                                                     "quanto-int8"])
@pytest.mark.parametrize("route", ["linear", "vmm"])
def test_tensor_subclass_weights_are_refused_before_anything_moves(quantize, family, route):
    model = tiny_flux_transformer()
    quantize(model)
    x = flux_inputs(model)
    with torch.no_grad():
        ref = model(**x)[0]
    with pytest.raises(ConfigError, match=rf"\({family}, .*route='resident'"):
        ddo_blocks.offload(model, route=route, device="cpu", vram_budget="min")
    assert ddo_blocks.get_handle(model) is None
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    handle = ddo_blocks.offload(model, route="resident", device="cpu")  # what the error offers
    with torch.no_grad():
        assert torch.equal(model(**x)[0], ref)
    handle.remove()


def test_a_module_built_under_inference_mode_is_refused_before_anything_moves():
    with torch.inference_mode():
        model = tiny_flux_transformer()
    with pytest.raises(ConfigError, match="inference tensor .* outside torch.inference_mode"):
        ddo_blocks.offload(model, device="cpu", vram_budget="min")
    assert ddo_blocks.get_handle(model) is None
    assert all(type(p) is nn.Parameter for p in model.parameters())
