"""The decode's cost beside the real model: the resident forward timed with and without a coded
row's decodes queued beside it, so that the compressed bound can take the decode as the model's own
kernels see it rather than as a synthetic GEMM load does.

``coded.decode_rate`` (what the planner weighs) times the decode kernel alone and beside a square
fp16 matmul load. A step's decodes run beside Flux's attention, GEMMs, norms and element-wise
kernels instead, which share the SMs, the L2 and the HBM with them differently. Here the resident
model runs its forward while a synthetic coded chunk (``coded._synthetic_chunk``, normal bf16
weights) is decoded again and again on a high-priority side stream, the decodes spread over the
blocks: each block's forward pre-hook queues its share once the compute stream reaches it, as a
coded unit's decode is queued when its copy lands while the blocks before it compute. What the
decodes add to the forward (medians of interleaved pairs) is their cost in the step:

    resident_with_decodes_s = resident step + decoded bytes / (decode rate in the model)

Used by ``benchmarks.codec_sweep`` for a second compressed bound per coded row,
``max(link_bytes / link, resident_with_decodes_s)``. Needs CUDA and the model resident.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch
from torch import nn

PAIRS = 6
"""Chunk and output buffers decoded in turn: six pairs of a synthetic chunk (8 Mi values, about 12 MiB
coded and 16 MiB decoded) are about 170 MiB, past the H200's 50 MB L2."""


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The modules the decodes are spread over: the model's streamed units (its repeated blocks)."""
    from ddo_blocks.units import split_units

    return [u.module for u in split_units(model)[0]]


def spread(total: int, parts: int) -> list[int]:
    """``total`` decodes over ``parts`` blocks, as even as whole numbers allow."""
    return [total * (i + 1) // parts - total * i // parts for i in range(parts)]


def resident_with_decodes(model: nn.Module, inputs: dict[str, Any], device: torch.device, codec: str,
                          decoded_bytes: int, repeats: int = 5) -> dict[str, Any]:
    """Times the resident ``model(**inputs)`` on ``device`` alone and with ``decoded_bytes`` of ``codec``
    decodes beside it (see the module's docstring), ``repeats`` interleaved pairs after one warm-up
    pair; the model must already be on ``device``. Returns the medians, the decodes' added seconds and
    the rate that implies (bf16 bytes written per second)."""
    from ddo_blocks import _native
    from ddo_blocks.streaming import coded

    buf, (src, length, values, escapes, groups) = coded._synthetic_chunk(codec)
    # copies of the chunk and outputs in turn, more than the L2 holds (a step's decodes read and write
    # memory no earlier decode touched; the same chunk again and again would stay in the L2)
    pairs = [(buf[src: src + length].to(device), torch.empty(values, dtype=torch.bfloat16, device=device))
             for _ in range(PAIRS)]
    turn = itertools.cycle(pairs)
    side = torch.cuda.Stream(device, priority=-1)  # as CodedSlabs.open_transport's decode stream
    ordinal = device.index or 0
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError("the model has no repeated blocks to spread the decodes over")
    decodes = max(1, round(decoded_bytes / (2 * values)))
    shares = spread(decodes, len(blocks))

    def decode(n: int) -> None:
        for _ in range(n):
            chunk, out = next(turn)
            _native.codec_decode_device(ordinal, side.cuda_stream, chunk.data_ptr(), out.data_ptr(), values,
                                        escapes, groups)

    def queue(n: int) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            if n:
                side.wait_stream(torch.cuda.current_stream(device))  # from where the compute is now
                decode(n)
        return pre

    def forward(with_decodes: bool) -> float:
        hooks = [b.register_forward_pre_hook(queue(n)) for b, n in zip(blocks, shares)] if with_decodes else []
        try:
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            with torch.no_grad():
                result = model(**inputs)
            torch.cuda.current_stream(device).wait_stream(side)  # the step ends when its decodes do
            torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t
            del result
            return elapsed
        finally:
            for h in hooks:
                h.remove()

    decode(1)  # the kernel's module is loaded
    torch.cuda.synchronize(device)
    forward(False), forward(True)
    alone, both = [], []
    for _ in range(repeats):
        alone.append(forward(False))
        both.append(forward(True))
    resident_s, with_s = statistics.median(alone), statistics.median(both)
    written = decodes * 2 * values
    added = with_s - resident_s
    return {"codec": codec, "decodes": decodes, "decoded_bytes": written, "blocks": len(blocks),
            "resident_s": resident_s, "resident_with_decodes_s": with_s, "added_s": added,
            "rate_gb_s": written / added / 1e9 if added > 0 else None}
