"""Measured link bandwidth, once per process and device, for the planner and the roofline.

``DDO_LINK_GBPS`` overrides the measurement (decimal GB/s), e.g. to plan for a slower card than the
one at hand.
"""

from __future__ import annotations

import os
import time

import torch

_CACHE: dict[str, float] = {}
_PROBE_BYTES = 256 << 20


def link_bytes_per_s(device: torch.device) -> float:
    """Host-to-device bandwidth of page-locked copies (CUDA), or memcpy bandwidth (CPU), in B/s."""
    env = os.environ.get("DDO_LINK_GBPS")
    if env:
        return float(env) * 1e9
    key = str(device)
    if key not in _CACHE:
        _CACHE[key] = _measure_cuda(device) if device.type == "cuda" else _measure_cpu()
    return _CACHE[key]


def compute_bytes_per_s(device: torch.device, link: float) -> float:
    """Weight bytes the device consumes per second of compute, used only to spread resident units
    before any call is measured. Diffusion transformers at 1024x1024 run several times faster than
    the link, so the prior is 3x the link: plans then favour hiding copies behind resident units."""
    return 3.0 * link


def _measure_cuda(device: torch.device) -> float:
    src = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)
    dst.copy_(src, non_blocking=True)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    end.record(stream)
    end.synchronize()
    return 3 * _PROBE_BYTES / (start.elapsed_time(end) / 1e3)


def _measure_cpu() -> float:
    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * n / max(time.perf_counter() - t0, 1e-9)
