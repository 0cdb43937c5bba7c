"""Many host tensors onto one GPU through two page-locked staging buffers.

Pageable ``tensor.to("cuda")`` runs at the driver's pageable rate (about 8 GB/s on the H200 machine)
one tensor at a time. Here the sources are packed by the caller's ``fill`` (parallel host copies, or
parallel file reads) into one staging buffer while the other buffer's uploads run, so setup moves
resident weights at close to the link's pinned rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .slabs import PinnedBuffer

STAGING_BYTES = 256 << 20
_ALIGN = 256


def staged_upload(
    pairs: list[tuple[Any, torch.Tensor]],
    device: torch.device,
    nbytes: Callable[[Any], int],
    fill: Callable[[list[tuple[Any, torch.Tensor]]], None],
    queued: Callable[[list[tuple[Any, torch.Tensor]]], None] | None = None,
) -> None:
    """Copies each ``(source, out)`` pair's source into ``out``, a tensor on CUDA ``device``.

    ``fill`` receives ``(source, view)`` pairs, each view a page-locked tensor shaped like its
    ``out``, and must write the source's bytes into it before returning. ``queued``, if given,
    receives each batch's ``(source, out)`` pairs once their uploads are queued on the current
    stream: the sources are no longer read, so the caller may free them (host memory then stays
    flat instead of growing by the staging buffers). Every source must fit ``STAGING_BYTES``. The
    second buffer is page-locked only when the first one is full. Returns once every upload
    finished (the buffers are then unpinned)."""
    if not pairs:
        return
    stream = torch.cuda.current_stream(device)
    pinned: list[PinnedBuffer] = []
    done = [torch.cuda.Event(), torch.cuda.Event()]
    turn, used = 0, 0
    pending: list[tuple[Any, torch.Tensor, int]] = []

    def flush() -> None:
        nonlocal turn, used, pending
        if not pending:
            return
        if len(pinned) <= turn:
            pinned.append(PinnedBuffer(STAGING_BYTES, device.index or 0))
        buf = pinned[turn].tensor
        views = [(src, buf[off : off + nbytes(src)].view(out.dtype).view(out.shape), out) for src, out, off in pending]
        fill([(src, v) for src, v, _ in views])
        for _, v, out in views:
            out.copy_(v, non_blocking=True)
        done[turn].record(stream)
        if queued is not None:
            queued([(src, out) for src, _, out in views])
        turn, used, pending = 1 - turn, 0, []
        if len(pinned) > turn:
            done[turn].synchronize()  # the other buffer's uploads finished: it can be refilled

    try:
        for src, out in pairs:
            n = nbytes(src)
            if n > STAGING_BYTES:
                raise ValueError(f"a {n}-byte source does not fit the {STAGING_BYTES}-byte staging buffer")
            if used + n > STAGING_BYTES:
                flush()
            pending.append((src, out, used))
            used += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        flush()
    finally:
        stream.synchronize()  # no upload may still read a buffer when it is unpinned
        for b in pinned:
            b.close()


def copy_from_host(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A ``fill`` for contiguous host tensors: parallel memcpy in Rust, GIL released."""
    from .. import _native

    _native.copy_host_many([(v.data_ptr(), src.data_ptr(), src.numel() * src.element_size()) for src, v in pairs])
