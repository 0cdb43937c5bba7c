"""Flux, staged by hand: encode, denoise and decode called one by one, each stage its own
Modular pipeline with its own DDO block, route and budget.

    python pipelines/flux_staged.py                    # the embedded tiny Flux model, on the CPU here
    python pipelines/flux_staged.py --model /models/FLUX.1-dev --device cuda --budget 6GiB

Between stages your code holds the tensors (prompt embeddings, latents): cache the embeddings of a
prompt, change the seed and denoise again, or decode later. The text encoders leave the device after
their stage (``release``), so the transformer has the room.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stages(device: str, *, encoder: Any = None, transformer: Any = None, vae: Any = None) -> dict[str, Any]:
    """The three stages of ``FluxAutoBlocks``, each wrapped in its DDO block (``None``: the default policy)."""
    from diffusers.modular_pipelines import FluxAutoBlocks

    from ddo_blocks.blocks import DecodeBlock, DenoiseBlock, TextEncoderBlock

    auto = FluxAutoBlocks()
    return {
        "text_encoder": TextEncoderBlock(auto.sub_blocks["text_encoder"], policy=encoder, device=device),
        "denoise": DenoiseBlock(auto.sub_blocks["denoise"], policy=transformer, device=device),
        "decode": DecodeBlock(auto.sub_blocks["decode"], policy=vae, device=device),
    }


def generate(components: dict[str, Any], blocks: dict[str, Any], *, prompt: str, seed: int,
             **call: Any) -> tuple[Any, dict[str, Any]]:
    """Runs the three stages one after the other. Returns the images and each stage's reports."""
    import torch

    from ddo_blocks.blocks import REPORTS_KEY

    pipes = {}
    for name, block in blocks.items():
        pipes[name] = block.init_pipeline()
        needed = {spec.name for spec in block.expected_components}
        pipes[name].update_components(**{k: v for k, v in components.items() if k in needed})
    reports: dict[str, Any] = {}

    enc = pipes["text_encoder"](prompt=prompt, max_sequence_length=call.pop("max_sequence_length", 512))
    reports.update(enc.get(REPORTS_KEY))
    den = pipes["denoise"](prompt_embeds=enc.get("prompt_embeds"),
                           pooled_prompt_embeds=enc.get("pooled_prompt_embeds"),
                           generator=torch.Generator("cpu").manual_seed(seed), **call)
    reports.update(den.get(REPORTS_KEY))
    dec = pipes["decode"](latents=den.get("latents"), height=call.get("height"), width=call.get("width"),
                          output_type="pt")
    reports.update(dec.get(REPORTS_KEY))
    for pipe in pipes.values():
        from ddo_blocks.blocks import remove_offload

        remove_offload(pipe)
    return dec.get("images"), reports


def main(argv: list[str] | None = None) -> int:
    import torch

    from ddo_blocks.blocks.runner import minimum_budget, save_images
    from ddo_blocks.errors import DdoError
    from ddo_blocks.tiny_pipeline import CALL_DEFAULTS, ensure_tiny_model, load_components

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", metavar="PATH", default=None,
                   help="a Diffusers Flux directory (default: the embedded tiny model, made once in .ddo_cache/)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda, cuda:N or cpu")
    p.add_argument("--encoder-route", default="diffusers", help="route of the text encoders (default: diffusers, leaf)")
    p.add_argument("--budget", default="min",
                   help="the transformer's VRAM budget on the linear route, e.g. 6GiB; 'min': resident weights + two slots of the largest block")
    p.add_argument("--vae-route", default="resident", help="route of the VAE (default: resident)")
    p.add_argument("--prompt", default="a photo of a cat on a tree")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs")
    args = p.parse_args(argv)

    tiny = args.model is None
    path = ensure_tiny_model("flux") if tiny else Path(args.model)
    components = load_components(path)
    call = {k: v for k, v in CALL_DEFAULTS["flux"].items()} if tiny else {}
    budget = minimum_budget(components["transformer"]) if args.budget == "min" else args.budget
    encoder: Any = args.encoder_route
    if encoder == "diffusers":
        encoder = {"route": "diffusers", "offload_type": "leaf_level", "use_stream": args.device.startswith("cuda")}
    try:
        blocks = stages(args.device, encoder=encoder,
                        transformer={"route": "linear", "vram_budget": budget}, vae=args.vae_route)
        images, reports = generate(components, blocks, prompt=args.prompt, seed=args.seed, **call)
    except DdoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for stage, per in reports.items():
        for comp, rep in per.items():
            print(f"\n[{stage}] {comp}\n{rep}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    image = save_images(images, out, name="image_staged")
    report = out / "report_flux_staged.json"
    report.write_text(json.dumps({s: {c: r.to_dict() for c, r in per.items()} for s, per in reports.items()},
                                 indent=2))
    print(f"\nimage written to {image.resolve()}\nreport written to {report.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
