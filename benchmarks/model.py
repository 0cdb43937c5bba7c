"""The benchmark model: a Flux-dev-sized ``FluxTransformer2DModel`` with random weights.

The weights are made once per run, by one *builder* process, on the device: the model is built on
the meta device, ``to_empty(device=...)``, every parameter filled with ``normal_(0, 0.02)`` (seeded),
and the bytes written into a *weight blob*, an anonymous in-memory file (``memfd``; a deleted
temporary file where memfd is missing) laid out as one 4 KiB aligned range per tensor. Processes
that run a route then read the blob into ordinary (pageable, private) CPU tensors, one per
parameter, which is what a loaded checkpoint looks like to an offloader.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

ALIGN = 4096

FLUX_DEV: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
"""Flux-dev's transformer: 19 double + 38 single blocks, 3072 wide (24 heads x 128), ~22.2 GiB in bf16."""

TINY: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,
    "out_channels": None,
    "num_layers": 2,
    "num_single_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": True,
    "axes_dims_rope": (4, 4, 8),
}
"""ddo_blocks.tiny's Flux config (2 double + 3 single blocks, 32 wide), with guidance like Flux-dev."""

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def skeleton(cfg: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The model on the meta device (no memory), in eval mode, without gradients."""
    from diffusers import FluxTransformer2DModel

    cfg = {**cfg, "axes_dims_rope": tuple(cfg["axes_dims_rope"])}
    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    for p in model.parameters():
        p.data = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device="meta")
        p.requires_grad_(False)
    return model.eval()


def random_model(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> nn.Module:
    """The model built on ``device`` with every parameter drawn from ``normal(0, 0.02)`` (seeded),
    left there (callers that offload move it to the CPU)."""
    model = skeleton(cfg, dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    return model


def layout(model: nn.Module) -> tuple[list[dict[str, Any]], int]:
    """One blob range per parameter and buffer: (entries, total bytes)."""
    entries = []
    off = 0
    for kind, items in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            n = t.numel() * t.element_size()
            entries.append(
                {
                    "name": name,
                    "kind": kind,
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).replace("torch.", ""),
                    "offset": off,
                    "nbytes": n,
                }
            )
            off += (n + ALIGN - 1) // ALIGN * ALIGN
    return entries, off


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def new_blob(nbytes: int, cache_dir: str | None = None) -> int:
    """A file descriptor of ``nbytes`` of anonymous memory (memfd), or of a deleted temporary file."""
    fd = -1
    if cache_dir is None and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create("ddo-bench-weights", 0)
        except OSError:
            fd = -1
    if fd < 0:
        with tempfile.TemporaryFile(dir=cache_dir) as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, max(nbytes, 1))
    return fd


def fill_blob(
    cfg: dict[str, Any],
    dtype: torch.dtype,
    entries: list[dict[str, Any]],
    fd: int,
    device: torch.device,
    seed: int,
) -> float:
    """Builds the model on ``device`` with random weights and writes it into the blob. Returns the
    seconds spent. Runs in the builder process (it initialises CUDA)."""
    import mmap
    import time

    t0 = time.perf_counter()
    model = skeleton(cfg, dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    total = max(e["offset"] + e["nbytes"] for e in entries) if entries else 0
    mm = mmap.mmap(fd, max(total, 1))
    blob = torch.frombuffer(mm, dtype=torch.uint8)
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    with torch.no_grad():
        for e in entries:
            t = named[e["name"]]
            if t.is_floating_point():
                t.normal_(0.0, 0.02, generator=gen)
            else:
                t.zero_()
        items = [(named[e["name"]], e["offset"]) for e in entries if e["nbytes"]]
        if device.type == "cuda":
            _d2h_bounce(items, blob.data_ptr(), device)
        else:
            for t, off in items:
                n = t.numel() * t.element_size()
                blob[off : off + n].view(t.dtype).view(t.shape).copy_(t)
    del blob, named, model, items
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def _d2h_bounce(
    items: list[tuple[torch.Tensor, int]],
    base: int,
    device: torch.device,
    chunk: int = 64 << 20,
    nbuf: int = 8,
) -> None:
    """Device tensors to host addresses through a ring of pinned buffers: one async copy per chunk
    into a free buffer, then a worker thread waits for its event and memmoves it to the destination
    (fresh pages), ``nbuf`` chunks in flight. A plain ``.copy_()`` into pageable memory runs at about
    1 GB/s here (25 s for 22 GiB); this is bound by the host page faults instead."""
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(nbuf)]
    events = [torch.cuda.Event() for _ in range(nbuf)]
    pending: list[Any] = [None] * nbuf
    stream = torch.cuda.current_stream(device)

    def land(ev: Any, src: int, dst: int, n: int) -> None:
        ev.synchronize()
        ctypes.memmove(dst, src, n)

    k = 0
    with ThreadPoolExecutor(max_workers=nbuf) as pool:
        for t, off in items:
            flat = t.detach().reshape(-1).view(torch.uint8)
            n = flat.numel()
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                i = k % nbuf
                k += 1
                if pending[i] is not None:
                    pending[i].result()
                bufs[i][: b - a].copy_(flat[a:b], non_blocking=True)
                events[i].record(stream)
                pending[i] = pool.submit(land, events[i], bufs[i].data_ptr(), base + off + a, b - a)
        for f in pending:
            if f is not None:
                f.result()
    torch.cuda.synchronize(device)


def _read_into(fd: int, t: torch.Tensor, offset: int) -> None:
    n = t.numel() * t.element_size()
    if n == 0:
        return
    view = memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
    done = 0
    while done < n:
        k = os.preadv(fd, [view[done:]], offset + done)
        if k <= 0:
            raise OSError(f"short read from the weight blob at {offset + done}")
        done += k


def load_model(
    cfg: dict[str, Any], dtype: torch.dtype, entries: list[dict[str, Any]], fd: int, threads: int = 8
) -> nn.Module:
    """The model with every tensor in its own private, pageable CPU allocation, read from the blob.

    Uses no torch kernels (only allocation and ``preadv`` in plain threads, joined before returning),
    so the calling process stays safe to fork."""
    model = skeleton(cfg, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        tensors[e["name"]] = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(lambda e: _read_into(fd, tensors[e["name"]], e["offset"]), entries))
    for e in entries:
        owner_name, _, leaf = e["name"].rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        t = tensors[e["name"]]
        if e["kind"] == "param":
            owner._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        else:
            owner._buffers[leaf] = t
    return model.eval()


def make_inputs(
    model: nn.Module,
    *,
    height_tokens: int,
    width_tokens: int,
    text_tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 1,
) -> dict[str, Any]:
    """One denoise step's inputs for a Flux transformer: packed latents (h x w tokens), T5-like text
    embeddings, pooled CLIP-like embedding, position ids, timestep and (when the model takes it)
    guidance, like FluxPipeline passes them."""
    cfg = model.config
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = height_tokens * width_tokens
    hidden = torch.randn(1, tokens, cfg.in_channels, generator=g).to(dtype)
    enc = torch.randn(1, text_tokens, cfg.joint_attention_dim, generator=g).to(dtype)
    pooled = torch.randn(1, cfg.pooled_projection_dim, generator=g).to(dtype)
    img_ids = torch.zeros(tokens, 3)
    img_ids[:, 1] = torch.arange(height_tokens).repeat_interleave(width_tokens).float()
    img_ids[:, 2] = torch.arange(width_tokens).repeat(height_tokens).float()
    txt_ids = torch.zeros(text_tokens, 3)
    out: dict[str, Any] = {
        "hidden_states": hidden,
        "encoder_hidden_states": enc,
        "pooled_projections": pooled,
        "timestep": torch.full((1,), 0.5).to(dtype),
        "img_ids": img_ids,
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    if cfg.guidance_embeds:
        out["guidance"] = torch.full((1,), 3.5, dtype=torch.float32)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
