"""The ddo_blocks offload block on its own: wraps any stage of any Modular pipeline. Load it with::

    from diffusers.modular_pipelines import FluxAutoBlocks, ModularPipelineBlocks

    denoise = ModularPipelineBlocks.from_pretrained(
        "pipelines/ddo_offload", trust_remote_code=True,
        block=FluxAutoBlocks().sub_blocks["denoise"], stage="denoise",
        policy={"route": "linear", "vram_budget": "6GiB"}, device="cuda",
    )

Keyword arguments are those of ``ddo_blocks.blocks.OffloadBlock``. Needs ddo_blocks installed: ``pip install .`` in a clone of this repository (needs Rust), or ``pip install ddo_blocks-*.whl`` built by ``make wheel`` (ddo-blocks is not on PyPI).
"""

from ddo_blocks.blocks import OffloadBlock


class DdoOffloadBlock(OffloadBlock):
    def __init__(self, block=None, stage=None, policy=None, components=None, device="cuda", preset="auto"):
        super().__init__(block, stage=stage, policy=policy, components=components, device=device, preset=preset)
