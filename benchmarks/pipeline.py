"""A classic ``FluxPipeline`` through ``ddo_blocks.offload_pipeline`` against the same pipeline all
resident, in one process: time per image, peak GPU memory, and whether the images are identical.

The components have Flux-dev's sizes (transformer 22.2 GiB, T5-XXL encoder 9.5 GiB, CLIP-L, the
Flux VAE) with random weights (seeded), built on the device in bf16 and moved to the CPU; the
tokenizers are ddo_blocks' in-code word-level ones. ``--tiny`` builds ddo_blocks' tiny components
instead (for the CPU and the tests).

    python -m benchmarks.pipeline --vram-budget 8GiB --steps 4 --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from datetime import UTC, datetime
from typing import Any

import torch

from benchmarks.measure import Timing, time_forward, write_rows

T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
              is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, bos_token_id=0, eos_token_id=2)
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159,
                scaling_factor=0.3611, sample_size=1024)


def _built(make: Any, seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = make()
    finally:
        torch.set_default_dtype(default)
    return model.to("cpu").eval().requires_grad_(False)


def full_size_components(device: str) -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from benchmarks.model import FLUX_DEV
    from ddo_blocks.tiny_pipeline import word_tokenizer

    return dict(
        transformer=_built(lambda: FluxTransformer2DModel(**FLUX_DEV), 0, device),
        text_encoder_2=_built(lambda: T5EncoderModel(T5Config(**T5_XXL)), 1, device),
        text_encoder=_built(lambda: CLIPTextModel(CLIPTextConfig(**CLIP_L)), 2, device),
        vae=_built(lambda: AutoencoderKL(**FLUX_VAE), 3, device),
        tokenizer=word_tokenizer(77),
        tokenizer_2=word_tokenizer(512),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                  max_shift=1.15),
    )


def _weights(components: dict[str, Any]) -> dict[str, int]:
    return {n: sum(p.numel() * p.element_size() for p in m.parameters())
            for n, m in components.items() if isinstance(m, torch.nn.Module)}


def _images(pipe: Any, device: torch.device, call: dict[str, Any], repeats: int) -> tuple[torch.Tensor, Timing]:
    """One warm-up image, then ``repeats`` timed ones (the harness's loop); the peak GPU counter is
    reset after the warm-up."""

    def image(**kw: Any) -> torch.Tensor:
        return pipe(generator=torch.Generator("cpu").manual_seed(0), output_type="pt", **kw).images

    timing = time_forward(image, call, device, repeats=repeats, after_warmup=lambda: _reset(device), keep_output=True)
    return timing.output.cpu(), timing


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from diffusers import FluxPipeline

    import ddo_blocks
    from ddo_blocks.tiny_pipeline import CALL_DEFAULTS, tiny_components

    device = torch.device(args.device)
    t0 = time.perf_counter()
    components = tiny_components("flux") if args.tiny else full_size_components(args.device)
    build_s = time.perf_counter() - t0
    pipe = FluxPipeline(**components)
    call: dict[str, Any] = dict(CALL_DEFAULTS["flux"]) if args.tiny else dict(height=1024, width=1024)
    call.update(prompt="a photo of an astronaut riding a horse", num_inference_steps=args.steps)
    if not args.tiny:
        call.update(max_sequence_length=512, guidance_scale=3.5)
    rows = []

    pipe.to(device)
    ref, timing = _images(pipe, device, call, args.repeats)
    rows.append({"pipeline": "all components resident", "vram_budget": None, "image_s": timing.step_s,
                 "first_image_s": timing.first_call_s, "peak_gpu_allocated": _peak(device), "exact": True})
    pipe.to("cpu")

    t1 = time.perf_counter()
    off = ddo_blocks.offload_pipeline(pipe, vram_budget=args.vram_budget, device=device)
    setup_s = time.perf_counter() - t1
    image, timing = _images(pipe, device, call, args.repeats)
    reports = {n: r.to_dict() for n, r in off.report().items()}
    rows.append({"pipeline": "offload_pipeline", "vram_budget": off.vram_budget,
                 "image_s": timing.step_s, "first_image_s": timing.first_call_s, "setup_s": setup_s,
                 "peak_gpu_allocated": _peak(device), "planned_gpu_bytes": off.gpu_bytes,
                 "policies": {n: p.describe() for n, p in off.policies.items()},
                 "exact": bool(torch.equal(image, ref))})
    off.remove()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.pipeline " + " ".join(args.argv),
        "commit": _commit(),
        "machine": _machine(device),
        "weights": _weights(components),
        "build_s": build_s,
        "call": {k: v for k, v in call.items() if isinstance(v, (int, float, str))},
        "repeats": args.repeats,
        "rows": rows,
        "reports": reports,
    }


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _machine(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    return f"{gpu}, {platform.platform()}, torch {torch.__version__}"


def markdown(doc: dict[str, Any]) -> str:
    from ddo_blocks import fmt_bytes

    lines = [f"# offload_pipeline: a classic FluxPipeline ({doc['machine']})", "",
             f"- date: {doc['date']}; commit: {doc['commit']}; command: `{doc['command']}`",
             "- weights: " + ", ".join(f"{n} {fmt_bytes(b)}" for n, b in doc["weights"].items()),
             f"- call: {json.dumps(doc['call'])}; time per image = median of {doc['repeats']} timed calls after a warm-up "
             "call; peak GPU over the timed calls",
             "", "| pipeline | VRAM budget | s / image | first image s | peak GPU allocated | exact |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['pipeline']} | {fmt_bytes(r['vram_budget']) if r['vram_budget'] else '-'} | "
                     f"{r['image_s']:.3f} | {r['first_image_s']:.3f} | {fmt_bytes(r['peak_gpu_allocated'])} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    pol = doc["rows"][-1].get("policies", {})
    lines += ["", "Policies chosen: " + "; ".join(f"{n}: {d}" for n, d in pol.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vram-budget", default="8GiB")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="timed images per pipeline, after one warm-up image")
    p.add_argument("--tiny", action="store_true", help="ddo_blocks' tiny components (CPU, tests)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    doc = run(args)
    return write_rows(args.out, "pipeline", doc, markdown(doc))


if __name__ == "__main__":
    raise SystemExit(main())
