"""Wan text-to-video through the Modular preset (``WanBlocks``) with DDO blocks; writes a GIF.

    python pipelines/wan_t2v.py                        # the embedded tiny Wan model, on the CPU here
    python pipelines/wan_t2v.py --model /models/Wan2.1-T2V-1.3B-Diffusers --device cuda \
        --denoise-budget 3GiB --height 480 --width 832

Wan's text-encoder step cleans prompts with ``ftfy``; where ``ftfy`` is not installed, the stage is
replaced by the same step with a plain whitespace/HTML clean (same embeddings for plain prompts).
"""

from __future__ import annotations

import sys

from _cli import main as _main


def _text_encoder_without_ftfy():
    import html
    import re

    import torch
    from diffusers.modular_pipelines.wan.encoders import WanTextEncoderStep

    def clean(text: str) -> str:
        return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()

    class WanPlainTextEncoderStep(WanTextEncoderStep):
        @staticmethod
        def encode_prompt(components, prompt, device=None, prepare_unconditional_embeds=True,
                          negative_prompt=None, max_sequence_length=512):
            device = device or components._execution_device
            prompts = prompt if isinstance(prompt, list) else [prompt]

            def embed(texts):
                enc, tok = components.text_encoder, components.tokenizer
                inputs = tok([clean(t) for t in texts], padding="max_length", max_length=max_sequence_length,
                             truncation=True, add_special_tokens=True, return_attention_mask=True,
                             return_tensors="pt")
                ids, mask = inputs.input_ids, inputs.attention_mask
                lens = mask.gt(0).sum(dim=1).long()
                out = enc(ids.to(device), mask.to(device)).last_hidden_state.to(dtype=enc.dtype, device=device)
                out = [u[:v] for u, v in zip(out, lens)]
                return torch.stack([torch.cat([u, u.new_zeros(max_sequence_length - u.size(0), u.size(1))])
                                    for u in out])

            negative = None
            if prepare_unconditional_embeds:
                neg = negative_prompt or ""
                negative = embed(len(prompts) * [neg] if isinstance(neg, str) else neg)
            return embed(prompts), negative

    return WanPlainTextEncoderStep()


def make_blocks():
    from diffusers.modular_pipelines import WanBlocks
    from diffusers.utils import is_ftfy_available

    blocks = WanBlocks()
    if not is_ftfy_available():
        blocks.sub_blocks["text_encoder"] = _text_encoder_without_ftfy()
    return blocks


def main(argv: list[str] | None = None) -> int:
    from ddo_blocks.blocks.runner import save_video

    return _main(argv, description=__doc__.splitlines()[0], family="wan", make_blocks=make_blocks,
                 output="videos", save=save_video)


if __name__ == "__main__":
    sys.exit(main())
