"""A LoRA on an offloaded Flux-dev-sized transformer: the step unfused and fused, and the switch
between two adapters, against the same offload without a LoRA and the resident model.

    python -m benchmarks.lora --budget 4 --resolution 1024 --rank 64 --repeats 5 --out "$OUT/lora"

Builds the Flux-dev-sized transformer (random bf16 weights, seeded, built on the device), measures
its resident step without and with a rank-``--rank`` LoRA on every attention and MLP projection of
the blocks (adapter ``a``; a second one, ``b``, is made alike), moves it to the host and offloads it
at ``--budget`` GiB. Then, as a user would: the step without a LoRA; the two adapters loaded after the
offload (peft puts them on the host beside the parked base weights, the offload gives each a device
copy its unit uses); the step with ``a`` unfused; ``set_adapters("b")`` and the next calls (the
switch, and the bytes they move against a steady call's: the base bytes only); ``fuse_lora`` of ``a``
(computed on the host) and the fused step. Outputs of the unfused rows are compared with the resident
model's with the same adapter (a hash of their bytes); the fused row is compared with nothing (the
resident model would fuse on the GPU, the offloaded one fuses where its weights are). Rows:
seconds per step (median), H2D bytes per call, peak GPU memory (``max_memory_allocated``), and
the ratio to the no-LoRA offloaded step (the target: unfused within 1.10x).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import platform
import subprocess
import sys
import time
import zlib
from typing import Any

from .measure import GIB, sync, time_forward, write_rows

TARGETS = (r".*blocks\.\d+\..*(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out|ff\.net\.0\.proj|"
           r"ff\.net\.2|ff_context\.net\.0\.proj|ff_context\.net\.2|proj_mlp|proj_out)")
"""Every attention and MLP projection of the double and single blocks."""


def _digest(t: Any) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _adapter(model: Any, name: str, rank: int, seed: int) -> dict[str, Any]:
    """Adds adapter ``name`` (random A and B, seeded) and returns its values on the host."""
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False),
                          adapter_name=name)
    with torch.no_grad():  # A and B drawn on the host so every device gets the same values
        for n, p in model.named_parameters():
            if f".{name}." in n and "lora_" in n:
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{n}".encode()))
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def _load(model: Any, name: str, rank: int, values: dict[str, Any]) -> None:
    """Adapter ``name`` added again with ``values`` (what a user's ``load_lora_weights`` does)."""
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False),
                      adapter_name=name)
    set_peft_model_state_dict(model, values, adapter_name=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=4.0, help="VRAM budget of the offload, GiB")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/lora")
    parser.add_argument("--tiny", action="store_true", help="the tiny Flux config (a check of the script)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)

    import torch

    import ddo_blocks

    from .model import FLUX_DEV, TINY, make_inputs, random_model, weight_bytes

    dev = torch.device(args.device)
    model = random_model(TINY if args.tiny else FLUX_DEV, dev)
    tokens = args.resolution // 16
    x = make_inputs(model, height_tokens=tokens, width_tokens=tokens, text_tokens=512, device=dev,
                    dtype=torch.bfloat16)
    weights = weight_bytes(model)
    rows: list[dict[str, Any]] = []

    cuda = dev.type == "cuda"

    def row(name: str, fwd: Any, handle: Any = None, **extra: Any) -> dict[str, Any]:
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        before = handle.report()["runtime"]["h2d_total_bytes"] if handle is not None else 0
        timing = time_forward(fwd, x, dev, repeats=args.repeats, warmup=2, keep_output=True)
        moved = (handle.report()["runtime"]["h2d_total_bytes"] - before) if handle is not None else 0
        r = {"row": name, "step_s": timing.step_s, "first_s": timing.first_call_s,
             "h2d_call_bytes": moved / (args.repeats + 2), "peak_gib": torch.cuda.max_memory_allocated(dev) / GIB if cuda else 0.0,
             "digest": _digest(timing.output[0]), **extra}
        rows.append(r)
        print(f"{name}: {r['step_s']:.4f} s, {r['h2d_call_bytes'] / 1e9:.2f} GB/call, {r['peak_gib']:.2f} GiB",
              flush=True)
        return r

    resident = row("resident, no LoRA", model)
    values_a = _adapter(model, "a", args.rank, 1)
    values_b = _adapter(model, "b", args.rank, 2)
    model.set_adapters("a")
    resident_a = row("resident, LoRA a", model)
    model.set_adapters("b")
    resident_b = row("resident, LoRA b", model)
    model.unload_lora()  # the plain model again: the LoRA comes after the offload, as users load it
    model.to("cpu")
    if cuda:
        torch.cuda.empty_cache()
    budget = int(args.budget * GIB) if not args.tiny else ddo_blocks.minimum_budget(model, device=dev)
    handle = ddo_blocks.offload(model, device=dev, vram_budget=budget)
    base = row("offloaded, no LoRA", model, handle)
    base["exact"] = base["digest"] == resident["digest"]
    t0 = time.perf_counter()
    _load(model, "a", args.rank, values_a)
    _load(model, "b", args.rank, values_b)
    model.set_adapters("a")
    load_s = time.perf_counter() - t0
    unfused = row("offloaded, LoRA a unfused", model, handle, load_s=load_s)
    unfused["exact"] = unfused["digest"] == resident_a["digest"]
    sync(dev)
    t0 = time.perf_counter()
    model.set_adapters("b")
    switch_s = time.perf_counter() - t0
    switched = row("offloaded, switched to LoRA b", model, handle, switch_s=switch_s)
    switched["exact"] = switched["digest"] == resident_b["digest"]
    model.set_adapters("a")
    t0 = time.perf_counter()
    model.fuse_lora(adapter_names=["a"])
    fuse_s = time.perf_counter() - t0
    fused = row("offloaded, LoRA a fused", model, handle, fuse_s=fuse_s)
    edits = handle.report()["edits"]
    roof = handle.report()["roofline"]
    handle.remove()
    for r in rows:
        r["vs_no_lora"] = r["step_s"] / base["step_s"]
    doc = {
        "command": "python -m benchmarks.lora " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu",
        "host": platform.node(),
        "torch": torch.__version__, "weights_gib": weights / GIB, "budget_gib": args.budget,
        "resolution": args.resolution, "rank": args.rank, "edits": edits, "roofline": roof,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "rows": rows,
    }
    md = [f"# LoRA on an offloaded Flux-dev-sized transformer ({doc['machine']}, {args.budget:g} GiB, "
          f"{args.resolution}x{args.resolution}, rank {args.rank})", "",
          "| row | step s | x no-LoRA offload | GB/call | peak GiB | exact | notes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        notes = ", ".join(f"{k} {r[k]:.2f} s" for k in ("load_s", "switch_s", "fuse_s") if k in r)
        md.append(f"| {r['row']} | {r['step_s']:.4f} | {r['vs_no_lora']:.3f} | {r['h2d_call_bytes'] / 1e9:.2f} | "
                  f"{r['peak_gib']:.2f} | {r.get('exact', '-')} | {notes} |")
    md += ["", f"Adapters: {edits['adapters']} parameters, {edits['adapter_bytes'] / 2**20:.1f} MiB, "
           f"{edits['adapter_device_copies']} with a device copy. Roofline bound of the no-LoRA plan: "
           f"{roof.get('bound_s')} s. Fused: {fused['step_s']:.4f} s."]
    return write_rows(args.out, "lora", doc, "\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
