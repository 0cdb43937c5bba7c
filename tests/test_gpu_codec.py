"""The codecs on a real GPU: each NVRTC decode kernel (fixed-rate, two-tier, Huffman) bit for bit against
the host reference (edge values, odd lengths, all-escape blocks), and ``codec="fixed"``, ``"tiered"`` and
``"huffman"`` exact against the resident forward at every budget with the landing buffers inside the
budget (a module that starts on the GPU: in tests/test_gpu.py). Marked ``gpu``: skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

import ddo_blocks
from ddo_blocks import _native
from ddo_blocks.streaming import coded

from .helpers import assert_restored, budgets, snapshot
from .test_gpu import _resident_reference, medium_flux, offload_exact_within_budget

pytestmark = pytest.mark.gpu


CODECS = ["fixed", "tiered", "huffman"]


def _chunk_case(values: torch.Tensor, codec: str) -> tuple[torch.Tensor, object]:
    """A bf16 tensor coded as one unit on the host: (host buffer, layout)."""
    n = values.numel()
    unit = coded._layout_one(codec, values, 1 << 62)
    assert unit.code == codec or not unit.coded_pieces
    buf = torch.zeros(unit.nbytes, dtype=torch.uint8)
    _native.codec_encode_unit(unit, [(values.data_ptr(), 2 * n)], buf.data_ptr())
    return buf, unit


def _cases():
    g = torch.Generator().manual_seed(0)
    normal = (torch.randn(3_000_001, generator=g) * 0.02).to(torch.bfloat16)
    bits = torch.randint(-32768, 32767, (100_003,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    specials = torch.tensor([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x0080, 0x7F7F],
                            dtype=torch.int32).to(torch.int16).view(torch.bfloat16).repeat(1001)[:10_007]
    escapes = torch.full((4 * 512,), 1e-30, dtype=torch.bfloat16)
    escapes[::512] = 1e30
    # two exponents only, one in nine the rarer: one-bit Huffman codes, 128 values a segment
    two = torch.where(torch.arange(70_001) % 9 == 0, torch.tensor(2.5), torch.tensor(1.25)).to(torch.bfloat16)
    return {"normal": normal, "random_bits": bits, "every_pattern": every, "specials_odd": specials,
            "all_escape_blocks": escapes, "nine": normal[:9].clone(), "two_exponents": two}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("case", list(_cases()))
def test_decode_kernel_matches_the_host_reference_bit_for_bit(case, codec):
    values = _cases()[case].contiguous()
    buf, unit = _chunk_case(values, codec)
    dev = torch.device("cuda")
    chunk_dev = buf.to(dev)
    out = torch.full((values.numel() + 8,), -1, dtype=torch.int16, device=dev)  # a guard after the end
    stream = torch.cuda.current_stream()
    for src, _, dst, n, esc, groups in unit.coded_pieces:
        _native.codec_decode_device(dev.index or 0, stream.cuda_stream, chunk_dev.data_ptr() + src,
                                    out.data_ptr() + dst, n, esc, groups)
    for src, length, dst in unit.raw_pieces:
        out.view(torch.uint8)[dst : dst + length].copy_(buf[src : src + length])
    torch.cuda.synchronize()
    got = out.cpu()
    assert torch.equal(got[: values.numel()], values.view(torch.int16))
    assert (got[values.numel():] == -1).all()


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("budget_name", ["all_streamed", "half", "all_resident"])
def test_coded_offload_is_exact_on_the_gpu_and_inside_its_budget(budget_name, codec):
    model = medium_flux()
    from ddo_blocks.tiny import flux_inputs

    x = flux_inputs(model, height=16, width=16, text_len=32, device="cuda")
    ref, activations = _resident_reference(model, x)
    snap = snapshot(model)
    budget = budgets(model)[budget_name]
    budget = budget + ddo_blocks.minimum_budget(model, codec=codec) - ddo_blocks.minimum_budget(model)
    handle = offload_exact_within_budget(model, x, ref, activations, budget, codec=codec)
    plan = handle.report()["plan"]
    report = handle.report()
    c = report["codec"]
    if plan["streamed_units"]:
        assert c["landing_bytes"] > 0 and c["decode_gb_s"] > 10, c
        ratio = {"fixed": (0.74, 0.77), "tiered": (0.66, 0.71), "huffman": (0.60, 0.69)}[codec]
        assert c["codec"] == codec and ratio[0] < c["ratio"] < ratio[1], c
        assert report["runtime"]["h2d_call_bytes"] == c["link_call_bytes"]
        assert report["memory"]["pinned_bytes"] == c["host_bytes"]
    handle.remove()
    assert_restored(model, snap)
