"""Tiny offline pipelines: every component of a Flux, SD3 or Wan pipeline built from a small config,
with tokenizers from an in-code word-level vocabulary. No network, ever.

``ensure_tiny_model(family)`` writes such a pipeline once, in the layout of a real Diffusers model
directory (``model_index.json`` plus one subfolder per component, weights as safetensors), under
``.ddo_cache/`` (or ``$DDO_CACHE_DIR``). The pipelines then load it through the same
``from_pretrained`` loaders a real model directory goes through, so ``--model PATH`` and the embedded
default share one code path.

The sizes follow diffusers' own test configs (``tests/pipelines/*``); the Flux transformer is the one of
``ddo_blocks.tiny`` (2 double + 3 single blocks, so the linear route has units to stream).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import env
from .tiny import TINY_AUTOENCODER_KL, TINY_FLUX_TRANSFORMER, _seeded

FAMILIES = ("flux", "sd3", "wan")
CACHE_VERSION = "2"
"""Bumped whenever a config below changes, so a stale cache is never reused."""

_WORDS = ["a", "an", "the", "of", "and", "in", "on", "with", "at", "photo", "painting", "drawing", "render", "cat", "dog", "fox", "owl", "bird", "fish", "tree", "house", "city", "forest", "river", "mountain", "lake", "sky", "sun", "moon", "star", "night", "day", "red", "green", "blue", "yellow", "white", "black", "small", "big", "old", "young", "happy", "sad", "cute", "astronaut", "horse", "riding", "wearing", "hat", "sitting", "on", "by", "under", "over", "beautiful"]

TINY_CLIP = dict(
    bos_token_id=1, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-5,
    num_attention_heads=4, num_hidden_layers=5, pad_token_id=0, vocab_size=1000, hidden_act="gelu",
    projection_dim=32,
)
TINY_T5 = dict(
    vocab_size=1000, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    pad_token_id=0, eos_token_id=2, decoder_start_token_id=0,
)
TINY_FLUX_VAE = {
    **TINY_AUTOENCODER_KL,
    # four levels, as in the real Flux and SD3 VAEs: a scale factor of 8 (a pipeline stage without the VAE
    # assumes 8 when it sizes the latents)
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (8, 8, 16, 16),
    "shift_factor": 0.0609,
    "scaling_factor": 1.5035,
}
TINY_SD3_TRANSFORMER = dict(
    sample_size=32, patch_size=1, in_channels=4, num_layers=3, attention_head_dim=8, num_attention_heads=4,
    caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
)
TINY_WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
    text_dim=32, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
TINY_WAN_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])

CALL_DEFAULTS: dict[str, dict[str, Any]] = {
    "flux": dict(height=32, width=32, num_inference_steps=2, max_sequence_length=16),
    "sd3": dict(height=32, width=32, num_inference_steps=2, max_sequence_length=16),
    "wan": dict(height=16, width=16, num_frames=5, num_inference_steps=2, max_sequence_length=16),
}
"""Call arguments that suit each tiny model (any real model takes its own)."""


def word_tokenizer(model_max_length: int = 77, *, bos_eos: bool = True):
    """A fast tokenizer over a fixed English word list (ids stay below the tiny encoders' vocab size)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + _WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos_eos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=model_max_length)


def _clip(with_projection: bool, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return _seeded(lambda: cls(CLIPTextConfig(**TINY_CLIP)), seed).eval()


def _t5(seed: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    if umt5:
        return _seeded(lambda: UMT5EncoderModel(UMT5Config(**TINY_T5)), seed).eval()
    return _seeded(lambda: T5EncoderModel(T5Config(**TINY_T5)), seed).eval()


def tiny_components(family: str = "flux", seed: int = 0) -> dict[str, Any]:
    """Every component of a tiny pipeline of ``family`` (``flux``, ``sd3`` or ``wan``), built in memory."""
    from diffusers import (
        AutoencoderKL,
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        UniPCMultistepScheduler,
        WanTransformer3DModel,
    )

    if family == "flux":
        return dict(
            transformer=_seeded(lambda: FluxTransformer2DModel(**TINY_FLUX_TRANSFORMER), seed).eval(),
            vae=_seeded(lambda: AutoencoderKL(**TINY_FLUX_VAE), seed + 1).eval(),
            text_encoder=_clip(False, seed + 2),
            tokenizer=word_tokenizer(77),
            text_encoder_2=_t5(seed + 3),
            tokenizer_2=word_tokenizer(512),
            scheduler=FlowMatchEulerDiscreteScheduler(),
        )
    if family == "sd3":
        return dict(
            transformer=_seeded(lambda: SD3Transformer2DModel(**TINY_SD3_TRANSFORMER), seed).eval(),
            vae=_seeded(lambda: AutoencoderKL(**{**TINY_FLUX_VAE, "latent_channels": 4}), seed + 1).eval(),
            text_encoder=_clip(True, seed + 2),
            tokenizer=word_tokenizer(77),
            text_encoder_2=_clip(True, seed + 3),
            tokenizer_2=word_tokenizer(77),
            text_encoder_3=_t5(seed + 4),
            tokenizer_3=word_tokenizer(256),
            scheduler=FlowMatchEulerDiscreteScheduler(),
        )
    if family == "wan":
        return dict(
            transformer=_seeded(lambda: WanTransformer3DModel(**TINY_WAN_TRANSFORMER), seed).eval(),
            vae=_seeded(lambda: AutoencoderKLWan(**TINY_WAN_VAE), seed + 1).eval(),
            text_encoder=_t5(seed + 2, umt5=True),
            tokenizer=word_tokenizer(512),
            scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                              flow_shift=3.0),
        )
    raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")


_PIPELINE_CLASS = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "wan": "WanPipeline"}


def default_cache_dir() -> Path:
    """``$DDO_CACHE_DIR`` if set, else ``.ddo_cache/`` in the current directory (git-ignored)."""
    return Path(env.raw("DDO_CACHE_DIR") or ".ddo_cache")


def save_model_dir(components: dict[str, Any], path: str | os.PathLike, family: str) -> Path:
    """Writes ``components`` as a Diffusers model directory (``model_index.json`` + subfolders)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"_class_name": _PIPELINE_CLASS[family], "_diffusers_version": _diffusers_version()}
    for name, comp in components.items():
        comp.save_pretrained(path / name)
        library = "diffusers" if type(comp).__module__.startswith("diffusers") else "transformers"
        index[name] = [library, type(comp).__name__]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def ensure_tiny_model(family: str = "flux", cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory of the tiny ``family`` model, generated (once) from the configs above.

    The directory is written to a temporary name and renamed into place, so a half-written cache is
    never read. Returns its path.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(FAMILIES)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-{family}-v{CACHE_VERSION}"
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{family}-", dir=root))
    try:
        save_model_dir(tiny_components(family), tmp, family)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its directory is complete
            if not (target / "model_index.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_components(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Loads every component listed in a Diffusers model directory's ``model_index.json`` with its own
    class's ``from_pretrained`` (offline: ``local_files_only``). Works for the tiny models and real ones."""
    import importlib

    path = Path(path)
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a Diffusers model directory (no model_index.json); pass the folder that holds "
            "model_index.json and the component subfolders"
        )
    index = json.loads(index_file.read_text())
    out: dict[str, Any] = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None or spec[1] is None:
            continue
        library, cls_name = spec
        cls = getattr(importlib.import_module(library), cls_name)
        kwargs: dict[str, Any] = {"local_files_only": True}
        if dtype is not None and isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            kwargs["torch_dtype" if library == "diffusers" else "dtype"] = dtype
        if hasattr(cls, "from_pretrained"):
            out[name] = cls.from_pretrained(path / name, **kwargs)
    return out
