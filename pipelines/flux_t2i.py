"""Flux text-to-image through the Modular preset (``FluxAutoBlocks``) with DDO blocks.

    python pipelines/flux_t2i.py                       # the embedded tiny Flux model, on the CPU here
    python pipelines/flux_t2i.py --model /models/FLUX.1-dev --device cuda \
        --denoise-route linear --denoise-preset one_shot_fast --denoise-budget 6GiB

Every stage is wrapped by ``ddo_blocks.wrap``; stages you do not set keep the pipeline preset's
default (``--preset``; docs/blocks.md has the table).
"""

from __future__ import annotations

import sys

from _cli import main as _main


def make_blocks():
    from diffusers.modular_pipelines import FluxAutoBlocks

    return FluxAutoBlocks()


def main(argv: list[str] | None = None) -> int:
    return _main(argv, description=__doc__.splitlines()[0], family="flux", make_blocks=make_blocks)


if __name__ == "__main__":
    sys.exit(main())
