"""The ddo_blocks offload block on its own: wraps any stage of any Modular pipeline. Load it with::

    from diffusers.modular_pipelines import FluxAutoBlocks, ModularPipelineBlocks

    denoise = ModularPipelineBlocks.from_pretrained(
        "pipelines/ddo_offload", trust_remote_code=True,
        block=FluxAutoBlocks().sub_blocks["denoise"], stage="denoise",
        policy={"route": "linear", "vram_budget": "6GiB"}, device="cuda",
    )

Keyword arguments are those of ``ddo_blocks.blocks.OffloadBlock``. Needs ``pip install ddo-blocks``.
"""

from ddo_blocks.blocks import OffloadBlock


class DdoOffloadBlock(OffloadBlock):
    def __init__(self, block=None, stage=None, policy=None, components=None, device="cuda", preset="auto"):
        super().__init__(block, stage=stage, policy=policy, components=components, device=device, preset=preset)
