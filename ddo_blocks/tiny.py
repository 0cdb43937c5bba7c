"""Tiny models built from configs in code: the embedded default for ``make run`` and the tests.

No network: every model here is constructed from a config with seeded random weights. The sizes
follow diffusers' own test configs, with a few more blocks so that offloading has units to stream.
"""

from __future__ import annotations

import torch

TINY_FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,
    out_channels=None,
    num_layers=2,
    num_single_layers=3,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=False,
    axes_dims_rope=(4, 4, 8),
)

TINY_AUTOENCODER_KL = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
)


def _seeded(fn, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def tiny_flux_transformer(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A FluxTransformer2DModel with 2 double and 3 single blocks (about 0.2 M parameters)."""
    from diffusers import FluxTransformer2DModel

    cfg = {**TINY_FLUX_TRANSFORMER, **overrides}
    model = _seeded(lambda: FluxTransformer2DModel(**cfg), seed)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def tiny_autoencoder_kl(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """An AutoencoderKL with two down and two up blocks."""
    from diffusers import AutoencoderKL

    cfg = {**TINY_AUTOENCODER_KL, **overrides}
    model = _seeded(lambda: AutoencoderKL(**cfg), seed)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def flux_inputs(model, batch: int = 1, height: int = 8, width: int = 8, text_len: int = 12, seed: int = 1,
                device: str | torch.device = "cpu") -> dict:
    """Random inputs for a (tiny) Flux transformer: packed latents, text embeddings, ids, timestep."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    tokens = height * width
    hidden = torch.randn(batch, tokens, cfg.in_channels, generator=g).to(dtype)
    enc = torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g).to(dtype)
    pooled = torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(dtype)
    img_ids = torch.zeros(tokens, 3)
    img_ids[:, 1] = torch.arange(height).repeat_interleave(width).float()
    img_ids[:, 2] = torch.arange(width).repeat(height).float()
    txt_ids = torch.zeros(text_len, 3)
    out = dict(
        hidden_states=hidden,
        encoder_hidden_states=enc,
        pooled_projections=pooled,
        timestep=torch.full((batch,), 0.5).to(dtype),
        img_ids=img_ids,
        txt_ids=txt_ids,
        return_dict=False,
    )
    if getattr(cfg, "guidance_embeds", False):
        out["guidance"] = torch.full((batch,), 3.5).to(dtype)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
