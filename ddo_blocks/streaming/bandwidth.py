"""Measured link bandwidth, once per process and device, for the planner and the roofline.

``DDO_LINK_GBPS`` overrides the measurement (decimal GB/s), e.g. to plan for a slower card than the
one at hand.
"""

from __future__ import annotations

import os
import time

import torch

from .. import env

_CACHE: dict[str, float] = {}
_PROBE_BYTES = 256 << 20


def link_bytes_per_s(device: torch.device) -> float:
    """Host-to-device bandwidth of page-locked copies (CUDA), or memcpy bandwidth (CPU), in B/s."""
    override = env.gbps("DDO_LINK_GBPS")
    if override is not None:
        return override
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
    from ..budget import fmt_bytes
    from ..errors import OffloadMemoryError
    from .slabs import PinnedBuffer  # exact-size pinning, released after the probe

    try:
        dst = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as exc:
        raise OffloadMemoryError(
            f"out of GPU memory on {device} for the {fmt_bytes(_PROBE_BYTES)} copy that measures the "
            "host-to-device bandwidth, before any weight moved: the module is as it was; free GPU memory, or "
            "set DDO_LINK_GBPS to give the bandwidth and skip the probe"
        ) from exc
    stream = torch.cuda.current_stream(device)
    with PinnedBuffer(_PROBE_BYTES, device.index or 0) as pinned:
        src = pinned.tensor
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


DISK_PROBE_BYTES = 256 << 20


def disk_bytes_per_s(path: str | os.PathLike, threads: int = 8) -> tuple[float, str]:
    """Read bandwidth of the disk holding ``path`` (B/s) and how it was obtained.

    ``DDO_DISK_GBPS`` (decimal GB/s) overrides the measurement. Otherwise the first 256 MiB of
    ``path`` (the model's own file) are read once with the NVMe route's reader: ``threads``
    parallel 4 MiB positional reads, ``O_DIRECT`` where the filesystem allows it, so the page cache
    does not flatter the figure. Without ``O_DIRECT`` (tmpfs, some network filesystems) the file may
    be served from the page cache and the figure overstates the disk; the description says so.
    Measured once per file and process.
    """
    override = env.gbps("DDO_DISK_GBPS")
    if override is not None:
        return override, f"DDO_DISK_GBPS={env.raw('DDO_DISK_GBPS')}"
    key = os.fspath(path)
    if key not in _DISK:
        from .. import _native

        bps, nbytes, direct = _native.measure_disk_read(key, DISK_PROBE_BYTES, threads)
        how = "O_DIRECT (page cache bypassed)" if direct else "buffered pread (may be served by the page cache)"
        _DISK[key] = (bps, f"{nbytes / 2**20:.1f} MiB read from {os.path.basename(key)} with {threads} readers, {how}")
    return _DISK[key]


_DISK: dict[str, tuple[float, str]] = {}
