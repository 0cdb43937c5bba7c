"""Quantized Flux-dev-sized transformers offloaded: GGUF Q8_0 (streamed as its bytes) and torchao's
int8 weight-only (refused by the streaming routes), against their resident step and diffusers' group
offloading of the same quantized model, in one run.

    python -m benchmarks.quantized --formats gguf-q8_0,torchao-int8 --budgets 2,4 --resolution 1024 \\
        --repeats 3 --out "$OUT/quantized"

Builds the Flux-dev-sized transformer (random bf16 weights, seeded, on the device) and quantizes it:
``gguf-q8_0`` replaces every Linear of its blocks by diffusers' ``GGUFLinear`` holding the weight as
GGUF Q8_0 blocks (a float16 scale and 32 int8 codes per 32 values, quantized here on the device), as
``from_single_file`` of a GGUF file builds it; ``torchao-int8`` applies torchao's
``Int8WeightOnlyConfig``. Rows per format: resident (the quantized model on the device), ours at each
``--budgets`` GiB (linear route), and diffusers' group offloading (block level, one block per group,
streams: ``route="diffusers"``). Per row: seconds per step (median), peak GPU memory
(``max_memory_allocated``), and whether the output equals the resident one (a hash of its bytes); a
row that cannot run says why (the streaming routes refuse torchao's tensors before anything moves).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import platform
import sys
import time
from typing import Any

from .measure import GIB, time_forward, write_rows


def _digest(t: Any) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def gguf_q8_0(model: Any) -> None:
    """Every Linear of the blocks as diffusers' GGUFLinear over GGUF Q8_0 blocks of its weight."""
    import torch
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter
    from gguf import GGMLQuantizationType

    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for parent in blocks.modules():
            for name, lin in list(parent.named_children()):
                if type(lin) is not torch.nn.Linear or lin.in_features % 32:
                    continue
                w = lin.weight.detach().float().reshape(lin.out_features, -1, 32)
                d = w.abs().amax(-1, keepdim=True) / 127
                q = torch.where(d > 0, w / d, torch.zeros_like(w)).round().clamp(-127, 127).to(torch.int8)
                blocks_ = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], -1)  # 2 + 32 bytes a block
                new = GGUFLinear(lin.in_features, lin.out_features, lin.bias is not None, compute_dtype=lin.weight.dtype,
                                 device="meta")
                new.weight = GGUFParameter(blocks_.reshape(lin.out_features, -1), quant_type=GGMLQuantizationType.Q8_0)
                new.bias = lin.bias
                setattr(parent, name, new)


def torchao_int8(model: Any) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())


FORMATS = {"gguf-q8_0": gguf_q8_0, "torchao-int8": torchao_int8}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="gguf-q8_0,torchao-int8")
    parser.add_argument("--budgets", default="2,4", help="VRAM budgets of our offload, GiB")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/quantized")
    parser.add_argument("--tiny", action="store_true", help="the tiny Flux config (a check of the script)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)

    import torch

    import ddo_blocks

    from .model import FLUX_DEV, TINY, make_inputs, random_model

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    rows: list[dict[str, Any]] = []
    tokens = args.resolution // 16
    for fmt in args.formats.split(","):
        model = random_model(TINY if args.tiny else FLUX_DEV, dev)
        FORMATS[fmt](model)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        x = make_inputs(model, height_tokens=tokens, width_tokens=tokens, text_tokens=512 if not args.tiny else 8,
                        device=dev, dtype=torch.bfloat16)

        def row(name: str, setup: Any, fmt: str = fmt, x: dict = x, model: Any = model, weights: int = weights,
                reference: dict[str, Any] | None = None) -> dict[str, Any]:
            r: dict[str, Any] = {"format": fmt, "row": name, "weights_gib": weights / GIB}
            handle = None
            try:
                t0 = time.perf_counter()
                handle = setup()
                r["setup_s"] = time.perf_counter() - t0
                if cuda:
                    torch.cuda.reset_peak_memory_stats(dev)
                timing = time_forward(model, x, dev, repeats=args.repeats, warmup=2, keep_output=True)
                r.update(step_s=timing.step_s, first_s=timing.first_call_s, digest=_digest(timing.output[0]),
                         peak_gib=torch.cuda.max_memory_allocated(dev) / GIB if cuda else 0.0)
                if reference:
                    r["exact"] = r["digest"] == reference["digest"]
            except ddo_blocks.DdoError as exc:  # ours: refused before anything moved
                r["refused"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run this format: the row says so
                r["refused"] = f"failed, {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            finally:
                if handle is not None:
                    try:
                        handle.remove()
                    except Exception as exc:  # noqa: BLE001 - the row says so; the next rows still run
                        r["remove_failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(r)
            print(f"{fmt} / {name}: {r.get('step_s', r.get('refused'))} exact={r.get('exact', '-')}"
                  f"{' ' + r['remove_failed'] if 'remove_failed' in r else ''}", flush=True)
            return r

        resident = row("resident", lambda: None)
        model.to("cpu")
        if cuda:
            torch.cuda.empty_cache()
        for b in args.budgets.split(","):
            budget = int(float(b) * GIB) if not args.tiny else ddo_blocks.minimum_budget(model, device=dev)
            row(f"ours {b} GiB", lambda budget=budget, m=model: ddo_blocks.offload(m, device=dev, vram_budget=budget),
                reference=resident)
        row("diffusers group offloading (block, streams)",
            lambda m=model: ddo_blocks.offload(m, route="diffusers", device=dev, **({"use_stream": False} if not cuda else {})),
            reference=resident)
        del model
        if cuda:
            torch.cuda.empty_cache()
    for r in rows:
        base = next((q for q in rows if q["format"] == r["format"] and q["row"] == "resident"), None)
        if base and "step_s" in r and "step_s" in base:
            r["vs_resident"] = r["step_s"] / base["step_s"]
    doc = {
        "command": "python -m benchmarks.quantized " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "resolution": args.resolution, "rows": rows,
    }
    md = [f"# Quantized Flux-dev-sized transformers offloaded ({doc['machine']}, {args.resolution}x{args.resolution})",
          "", "| format | row | weights GiB | step s | x resident | peak GiB | exact | note |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = f"{r['step_s']:.4f}" if "step_s" in r else "-"
        ratio = f"{r['vs_resident']:.2f}" if "vs_resident" in r else "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        md.append(f"| {r['format']} | {r['row']} | {r['weights_gib']:.2f} | {step} | {ratio} | {peak} | "
                  f"{r.get('exact', '-')} | {r.get('refused', '')} |")
    return write_rows(args.out, "quantized", doc, "\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
