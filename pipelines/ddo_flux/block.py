"""Flux text-to-image and image-to-image (``FluxAutoBlocks``) with every stage wrapped in a
ddo_blocks offload block. Load it with::

    from diffusers.modular_pipelines import ModularPipelineBlocks

    blocks = ModularPipelineBlocks.from_pretrained(
        "pipelines/ddo_flux", trust_remote_code=True,
        denoise={"route": "linear", "preset": "one_shot_fast", "vram_budget": "6GiB"}, device="cuda",
    )
    pipe = blocks.init_pipeline("black-forest-labs/FLUX.1-dev")

Keyword arguments are those of ``ddo_blocks.wrap``: ``text_encoder``, ``denoise``, ``decode`` (each a
route name, a mapping or an ``OffloadPolicy``), ``device`` and ``preset``. Needs ddo_blocks installed: ``pip install .`` in a clone of this repository (needs Rust), or ``pip install ddo_blocks-*.whl`` built by ``make wheel`` (ddo-blocks is not on PyPI).
"""

import torch
from diffusers.modular_pipelines import FluxAutoBlocks

import ddo_blocks


class DdoFluxAutoBlocks(FluxAutoBlocks):
    def __init__(self, text_encoder=None, denoise=None, decode=None, device=None, preset="auto"):
        super().__init__()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        wrapped = ddo_blocks.wrap(FluxAutoBlocks(), text_encoder=text_encoder, denoise=denoise, decode=decode,
                                  device=device, preset=preset)
        self.sub_blocks = wrapped.sub_blocks
