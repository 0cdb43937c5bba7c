"""Stable Diffusion 3 text-to-image through the Modular preset (``StableDiffusion3AutoBlocks``) with
DDO blocks: three text encoders (two CLIP, one T5), the SD3 transformer, the VAE.

    python pipelines/sd3_t2i.py                        # the embedded tiny SD3 model, on the CPU here
    python pipelines/sd3_t2i.py --model /models/stable-diffusion-3.5-medium --device cuda --denoise-budget 4GiB
"""

from __future__ import annotations

import sys

from _cli import main as _main


def make_blocks():
    from diffusers.modular_pipelines import StableDiffusion3AutoBlocks

    return StableDiffusion3AutoBlocks()


def main(argv: list[str] | None = None) -> int:
    return _main(argv, description=__doc__.splitlines()[0], family="sd3", make_blocks=make_blocks)


if __name__ == "__main__":
    sys.exit(main())
