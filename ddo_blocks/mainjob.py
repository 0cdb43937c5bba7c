"""The main job of ``make run``: the staged Flux-architecture Modular pipeline with DDO blocks.

By default it runs the embedded tiny Flux model (generated once from a config into ``.ddo_cache/``
and loaded with diffusers' ``from_pretrained``) with mixed routes: Diffusers leaf offloading for the
text encoders, the linear route for the transformer with the smallest budget (every block streams),
the VAE resident. It prints each block's report, checks the image against the same pipeline without
offloading, writes the image and the report JSON, and says where. ``--model PATH`` runs a real
Diffusers Flux directory the same way (on a GPU).
"""

from __future__ import annotations

import argparse


# -------------------------------------------------------------------------------------------------
# the main job: the staged Flux Modular pipeline
# -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m ddo_blocks run`` (``make run ARGS=...``)."""
    from .blocks.runner import StageDefaults
    from .blocks.runner import add_arguments as add_pipeline_arguments

    p.description = (
        "Run the staged Flux Modular pipeline (text_encoder -> denoise -> decode), each stage wrapped in "
        "a DDO block with its own route, preset and VRAM budget; print each block's report and write the "
        "image and the report JSON."
    )
    add_pipeline_arguments(
        p,
        family="flux",
        defaults=StageDefaults(
            routes={"text_encoder": "diffusers", "denoise": "linear", "decode": "resident"},
            presets={"text_encoder": "diffusers_leaf_offload_compat"},
            budgets={"denoise": "min"},
        ),
    )


def run(args: argparse.Namespace) -> int:
    from diffusers.modular_pipelines import FluxAutoBlocks

    from .blocks.runner import run as run_pipeline

    return run_pipeline(args, family="flux", make_blocks=FluxAutoBlocks, output="images")
