"""A classic ``FluxPipeline`` through ``ddo_blocks.offload_pipeline`` against the same pipeline all
resident, in one process: time per generation and phase, bytes sent, peak memory, identical images.

The components have Flux-dev's sizes (transformer 22.2 GiB, T5-XXL encoder 9.5 GiB, CLIP-L, the
Flux VAE) with random weights (seeded), built on the device in bf16 and moved to the CPU; the
tokenizers are ddo_blocks' in-code word-level ones. ``--tiny`` builds ddo_blocks' tiny components
instead (for the CPU and the tests).

    python -m benchmarks.pipeline --budgets 8,16,24 --routes linear,vmm --steps 28 --generations 3 --out DIR

Rows: all components resident, then per budget ``offload_pipeline(pipe, vram_budget=B)`` (the linear
route, its default per-component split) and ``offload_pipeline(pipe, preset="vmm_fast", vram_budget=B)``
(one arena for every component). Each row runs three generations in a row with different prompts
and reports each generation's encode, denoise and decode time and the bytes it sent, and whether its
images and the latents its VAE decoded equal the resident row's.

    python -m benchmarks.pipeline --card 10 --budgets auto --routes vmm,linear,sequential_cpu_offload --out DIR

On a card (``--card``, the rest of the device filled), ``auto`` is ``Arena("auto")`` for the vmm route
and, for the linear route and the peers, the static split that fits the card: the free memory less
the resident row's largest phase activations (a VAE decode's) less the arena's margin. A generation
in which a first call ran out of device memory beside an ``"auto"`` budget (the component attached at
its smallest plan, the error saying to call again) runs again; the Markdown says which and why. It
ends with the vmm rows' gain against the linear rows' and each peer against our fastest row at or
below its peak (the driver's used memory).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch

from benchmarks.measure import call_again, host_rss, write_rows

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


PROMPTS = ("a photo of an astronaut riding a horse", "a watercolor of a lighthouse at dusk",
           "a macro photo of a dew-covered leaf")
"""One prompt per generation, in turn: every generation encodes anew."""


class _Phases:
    """Times the phases of one pipeline call from hooks on the denoiser (the device synchronised at
    each step's start and end): encode = call start to the first denoiser step, denoise = first step
    start to last step end, decode = the rest (VAE decode and post-processing). Samples the driver's
    used memory (``cudaMemGetInfo``) at each step boundary, and PyTorch's peak allocated between
    boundaries: a phase's activations are that peak less what was allocated when the phase began
    (encode; each step, the scheduler's work after it counted with it; decode)."""

    def __init__(self, denoiser: torch.nn.Module, device: torch.device):
        self.device = device
        self.first: float | None = None
        self.last: float | None = None
        self.used_peak = 0
        self.alloc_peak = 0
        self.activations = {"encode": 0, "denoise": 0, "decode": 0}
        self._phase = "encode"
        self._start_alloc = 0
        self.filled = _FILLED.get(device.index or 0, 0) if device.type == "cuda" else 0
        self._hooks = [denoiser.register_forward_pre_hook(self._pre), denoiser.register_forward_hook(self._post)]

    def _mark(self, ends: str | None, then: str) -> float:
        """A boundary: the segment since the last one belongs to phase ``ends`` (``None``: nothing
        before it), the next one to ``then``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self.used_peak = max(self.used_peak, total - free - self.filled)
            peak, now = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
            self.alloc_peak = max(self.alloc_peak, peak - self.filled)
            if ends is not None:
                self.activations[ends] = max(self.activations[ends], peak - self._start_alloc)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_alloc = now
        self._phase = then
        return time.perf_counter()

    def _pre(self, *_: Any) -> None:
        t = self._mark("encode" if self._phase == "encode" else "denoise", "denoise")
        if self.first is None:
            self.first = t

    def _post(self, *_: Any) -> None:
        self.last = self._mark("denoise", "after step")

    def run(self, fn: Any) -> tuple[Any, dict[str, float]]:
        self.first = self.last = None
        t0 = self._mark(None, "encode")
        out = fn()
        t1 = self._mark("decode" if self._phase == "after step" else self._phase, "encode")
        first, last = self.first or t0, self.last or t1
        return out, {"encode_s": first - t0, "denoise_s": last - first, "decode_s": t1 - last, "total_s": t1 - t0}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def _uploaded(off: Any) -> int:
    """Bytes this offload has sent to the device so far: every component's streamed copies plus the
    arena's placements and restores (the vmm route)."""
    if off is None:
        return 0
    reports = [r.to_dict() for r in off.report().values()]
    total = sum(r["runtime"].get("h2d_total_bytes") or 0 for r in reports)
    arenas = [r["arena"] for r in reports if r.get("arena")]  # offload_pipeline's one arena, in every report
    if arenas:
        total += (arenas[0].get("placed_bytes") or 0) + (arenas[0].get("restored_bytes") or 0)
    return total


def _generations(pipe: Any, device: torch.device, call: dict[str, Any], n: int, off: Any = None
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], list[dict[str, Any]], dict[str, int]]:
    """``n`` generations, a different prompt each (seed 0): per generation the image and the latents
    the VAE decoded (to tell an offload's error from a resident component's own kernel choice), its
    phase times and the bytes it sent; and the peaks (torch's allocated, the driver's used)."""
    _reset(device)
    phases = _Phases(pipe.transformer, device)
    outs, gens, decoded = [], [], []
    vae = pipe.vae
    own = vars(vae).get("decode")  # a peer's own patch, if any, is put back as it was
    decode = vae.decode

    def recording(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        decoded.append(z.detach().to("cpu", copy=True))
        return decode(z, *args, **kwargs)

    vae.decode = recording
    try:
        for i in range(n):
            failed: list[str] = []
            while True:
                sent0 = _uploaded(off)
                decoded.clear()
                try:
                    img, times = phases.run(lambda i=i: pipe(
                        prompt=PROMPTS[i % len(PROMPTS)], output_type="pt",
                        generator=torch.Generator("cpu").manual_seed(0), **call).images)
                    break
                except torch.OutOfMemoryError as exc:
                    why = call_again(exc)
                    if why is None or len(failed) >= MAX_CALLS_AGAIN:
                        raise
                    failed.append(why)  # a component of ours attached smaller: the generation runs again
                    del exc
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            outs.append((img.cpu(), decoded[-1] if decoded else None))
            gens.append({**times, "uploaded_bytes": _uploaded(off) - sent0,
                         **({"out_of_memory_before": failed} if failed else {})})
    finally:
        phases.close()
        if own is None:
            del vae.decode
        else:
            vae.decode = own
    return outs, gens, {"peak_gpu_allocated": phases.alloc_peak, "peak_driver_used": phases.used_peak,
                        "activation_bytes": dict(phases.activations) if device.type == "cuda" else None}


MAX_CALLS_AGAIN = 4
"""Times a generation runs again after an offload of ours ran out of device memory at a first call and
attached smaller (``vram_budget="auto"``, ``Arena("auto")``: one per component at most)."""


def _compared(outs: list[tuple[torch.Tensor, torch.Tensor | None]],
              refs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> dict[str, bool]:
    """``exact``: every image equals the resident row's; ``latents_exact``: every latent the VAE
    decoded does: an image that differs from identical latents is the decode's doing (a kernel it chose
    otherwise, or the VAE's own offload where it has one), not the denoiser's or the encoders'."""
    return {"exact": all(torch.equal(a[0], b[0]) for a, b in zip(outs, refs)),
            "latents_exact": all(a[1] is not None and b[1] is not None and torch.equal(a[1], b[1])
                                 for a, b in zip(outs, refs))}


_FILLED: dict[int, int] = {}
"""Bytes of the card filler (``--card``) per device index: taken off every peak reported."""


def _fill_card(device: torch.device, card_gib: float | None) -> torch.Tensor | None:
    """Leave only ``card_gib`` GiB free on the device (a smaller card, simulated) with one filler
    tensor, counted out of the peaks; ``None``: the whole card."""
    if card_gib is None or device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    blocked = free - int(card_gib * 2**30)
    if blocked <= 0:
        return None
    _FILLED[device.index or 0] = blocked
    return torch.empty(blocked, dtype=torch.uint8, device=device)


def _fitted_budget(device: torch.device, activations: dict[str, int] | None) -> dict[str, Any] | None:
    """The largest total for a static split on this card (``--budgets auto`` for the linear route and
    the peers): the free memory ``F`` (as ``vram_budget="auto"`` measures it) less the largest phase
    activations of the resident row less the margin ``Arena("auto")`` keeps (256 MiB + 5 % of ``F``).
    A static split holds its weights through every phase, so the VAE decode's activations must fit
    beside the denoiser's resident weights; the arena gives the decode those pages only while it runs.
    ``None`` without CUDA (nothing measured)."""
    if device.type != "cuda" or not activations:
        return None
    from ddo_blocks.autobudget import MARGIN_BYTES, MARGIN_FRACTION, free_bytes

    free = free_bytes(device)
    margin = int(MARGIN_BYTES + MARGIN_FRACTION * free)
    phase, largest = max(activations.items(), key=lambda kv: kv[1])
    return {"budget_bytes": max(1, free - largest - margin), "free_bytes": free, "largest_phase": phase,
            "activation_bytes": largest, "margin_bytes": margin}


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
    call: dict[str, Any] = (dict(CALL_DEFAULTS["flux"]) if args.tiny
                            else dict(height=args.resolution, width=args.resolution))
    call.pop("prompt", None)
    call.update(num_inference_steps=args.steps)
    if not args.tiny:
        call.update(max_sequence_length=512, guidance_scale=3.5)
    budgets: list[Any] = ["auto" if b == "auto" else ddo_blocks.parse_bytes(b if not b[-1:].isdigit() else b + "GiB",
                                                                             what="budget")
                          for b in args.budgets.split(",") if b]
    rows: list[dict[str, Any]] = []
    doc = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.pipeline " + " ".join(args.argv),
        "commit": _commit(),
        "machine": _machine(device),
        "weights": _weights(components),
        "build_s": build_s,
        "call": {k: v for k, v in call.items() if isinstance(v, (int, float, str))},
        "prompts": list(PROMPTS[: args.generations]),
        "rows": rows,
    }

    def written() -> None:  # after every row: a run cut short by its time limit keeps what it measured
        write_rows(args.out, "pipeline", doc, markdown(doc))

    _reset(device)
    pipe.to(device)
    rss0 = host_rss()  # the baseline of every row's host memory: the weights on the device, not in RAM
    refs, gens, peaks = _generations(pipe, device, call, args.generations)
    rows.append({"pipeline": "all components resident", "route": "resident", "vram_budget": None,
                 "generations": gens, **peaks, "host_rss_over_baseline": 0, "exact": True, "latents_exact": True})
    pipe.to("cpu")
    filler = _fill_card(device, args.card)  # noqa: F841 (held for the offloaded rows)
    doc["card_gib"] = args.card
    fit = _fitted_budget(device, peaks["activation_bytes"])
    doc["fitted_budget"] = fit
    written()

    presets = {"linear": "auto", "vmm": "vmm_fast"}
    asked = [r for r in args.routes.split(",") if r]
    ours = [r for r in asked if r.partition("+")[0] in presets]
    unknown = [r for r in asked if r not in ours and r not in PEERS]
    if unknown:
        raise SystemExit(f"--routes takes {', '.join([*presets, *PEERS])} (ours with +fixed or +tiered: the "
                         f"denoiser's codec; linear+graph: its CUDA graphs), got {', '.join(unknown)}")
    for route in ours:
        base, *suffixes = route.split("+")
        codecs = [s for s in suffixes if s != "graph"]
        denoiser_options: dict[str, Any] = {"codec": codecs[0]} if codecs else {}
        if "graph" in suffixes:
            denoiser_options["graph"] = True
        for budget in budgets:
            _reset(device)
            t1 = time.perf_counter()
            own = {_denoiser_name(pipe): {"route": base, **denoiser_options}} if denoiser_options else {}
            asked_budget = budget
            if budget == "auto" and base == "linear":  # no arena: the static split that fits the card
                if fit is None:
                    rows.append({"pipeline": f"offload_pipeline {route}", "route": route, "vram_budget": budget,
                                 "error": "the linear route at 'auto' is the static split fitted to the card from the "
                                          "resident row's measured activations: it needs a CUDA device"})
                    written()
                    continue
                budget = fit["budget_bytes"]
            try:
                off = ddo_blocks.offload_pipeline(pipe, vram_budget=budget, device=device, preset=presets[base], **own)
            except ddo_blocks.DdoError as exc:
                rows.append({"pipeline": f"offload_pipeline {route}", "route": route, "vram_budget": budget,
                             "error": f"{type(exc).__name__}: {exc}"})
                written()
                continue
            setup_s = time.perf_counter() - t1
            rss = host_rss() - rss0
            try:
                images, gens, peaks = _generations(pipe, device, call, args.generations, off)
                reports = {n: r.to_dict() for n, r in off.report().items()}
                arena = reports.get("transformer", {}).get("arena")
                graph = reports.get("transformer", {}).get("graph")
                rows.append({
                    "pipeline": f"offload_pipeline {route}" + (" (static split fitted to the card)"
                                                               if budget != asked_budget else ""),
                    "route": route, "vram_budget": budget, "asked_budget": asked_budget,
                    "link_gb_s": reports.get(_denoiser_name(pipe), {}).get("roofline", {}).get("link_gb_s"),
                    "setup_s": setup_s, "generations": gens, **peaks, "host_rss_over_baseline": rss,
                    "arena_peak_bytes": arena["peak_device_bytes"] if arena else None,
                    "arena": arena,
                    "graph": graph,
                    "peak_device_weights": arena["peak_device_bytes"] if arena else off.gpu_bytes,
                    "policies": {n: p.describe() for n, p in off.policies.items()},
                    **_compared(images, refs),
                })
            finally:
                off.remove()
                host_rss()  # freed host slabs back to the system before the next row
            print(f"{route} {_label(budget)}: " + ", ".join(
                f"gen{i + 1} {g['total_s']:.2f} s (encode {g['encode_s']:.2f}, denoise {g['denoise_s']:.2f}, decode "
                f"{g['decode_s']:.2f}, {g['uploaded_bytes'] / 1e9:.1f} GB)" for i, g in enumerate(rows[-1]["generations"])),
                flush=True)
            written()
    peers = [r for r in asked if r in PEERS]
    last_only = [r for r in peers[:-1] if PEERS[r].undo is None]
    if last_only:
        raise SystemExit(f"--routes: {', '.join(last_only)} cannot be taken off a pipeline again; put it last "
                         "(one such peer per run)")
    for peer in peers:  # after ours
        spec = PEERS[peer]
        steps = min(args.steps, args.slow_peer_steps) if spec.slow else args.steps
        _reset(device)
        t1 = time.perf_counter()
        try:
            note = spec.attach(pipe, device, next((b for b in budgets if b != "auto"),
                                                  fit["budget_bytes"] if fit else None))
        except Exception as exc:  # a peer that cannot run here (CUDA only, not installed) is a row that says so
            rows.append({"pipeline": spec.label, "route": peer, "vram_budget": None,
                         "error": f"{type(exc).__name__}: {exc}"})
            written()
            continue
        setup_s = time.perf_counter() - t1
        try:
            images, gens, peaks = _generations(pipe, device, {**call, "num_inference_steps": steps}, args.generations)
        except Exception as exc:  # the peer failed on this pipeline: its row says how, the next peers still run
            row = {"pipeline": spec.label, "route": peer, "vram_budget": None, "note": note,
                   "error": f"{type(exc).__name__} while generating: {str(exc)[:300]}"}
            rows.append(row)
            try:
                if spec.undo is not None:
                    spec.undo(pipe)
            except Exception as undo_exc:  # the pipeline's state is unknown now: no later row would be fair
                row["error"] += f"; taking it off failed too ({type(undo_exc).__name__}): the run stops here"
                written()
                break
            written()
            continue
        for g in gens:
            g["uploaded_bytes"] = None  # the peers do not count what they send
            if steps != args.steps:  # its denoise scaled to the asked steps, said so in the row
                g["denoise_s"] *= args.steps / steps
                g["total_s"] = g["encode_s"] + g["denoise_s"] + g["decode_s"]
        rows.append({"pipeline": spec.label + (f" ({steps} steps run, denoise scaled to {args.steps})"
                                               if steps != args.steps else ""),
                     "route": peer, "vram_budget": None, "setup_s": setup_s, "steps_run": steps, "note": note,
                     "generations": gens, **peaks, "host_rss_over_baseline": host_rss() - rss0,
                     **(_compared(images, refs) if steps == args.steps else {"exact": None})})
        print(f"{peer}: " + ", ".join(f"gen{i + 1} {g['total_s']:.2f} s" for i, g in enumerate(gens)), flush=True)
        if spec.undo is not None:
            spec.undo(pipe)
        written()
    return doc


def _label(budget: Any) -> str:
    from ddo_blocks import fmt_bytes

    return budget if isinstance(budget, str) else fmt_bytes(budget)


def _denoiser_name(pipe: Any) -> str:
    from ddo_blocks.pipeline import _denoiser, _modules

    return _denoiser(_modules(pipe))


def _model_cpu_offload(pipe: Any, device: torch.device, budget: int | None) -> str:
    pipe.enable_model_cpu_offload(device=device)
    return "pipe.enable_model_cpu_offload(device)"


def _sequential_cpu_offload(pipe: Any, device: torch.device, budget: int | None) -> str:
    pipe.enable_sequential_cpu_offload(device=device)
    return "pipe.enable_sequential_cpu_offload(device)"


def _remove_hooks(pipe: Any) -> None:
    pipe.remove_all_hooks()
    pipe.to("cpu")


def _group_offload(pipe: Any, device: torch.device, budget: int | None) -> str:
    pipe.enable_group_offload(onload_device=device, offload_type="block_level", num_blocks_per_group=1,
                              use_stream=device.type == "cuda")
    return "pipe.enable_group_offload(device, offload_type='block_level', num_blocks_per_group=1, use_stream=True)"


def _ddo(pipe: Any, device: torch.device, budget: int | None) -> str:
    """The original DDO, component by component as ``offload_pipeline`` splits the same total: the
    denoiser's share as DDO's resident budget (its automatic policy off), the other streamed
    components at a resident budget of 0, the small ones moved to the device."""
    if device.type != "cuda":
        raise RuntimeError("the original DDO (0.1.0rc2) needs a CUDA device")
    import os

    import diffusers_dynamic_offloader as ddo

    from ddo_blocks.pipeline import _denoiser, _modules, plan_policies

    modules = _modules(pipe)
    policies = plan_policies(modules, budget, "auto", {})
    denoiser = _denoiser(modules)
    done = []
    for name, module in modules.items():
        pol = policies[name]
        if pol.route == "resident":
            module.to(device)
            done.append(f"{name}: .to(device)")
            continue
        gib = (pol.vram_budget or 0) / 2**30 if name == denoiser else 0.0
        env = {**os.environ, "DDO_AUTO_BUDGET_POLICY": "off", "DDO_RESIDENT_MODULE_BUDGET_GB": f"{gib:.6g}"}
        result = ddo.enable_offload(module, preset="one_shot_fast", component=name,
                                    execution_device=f"cuda:{device.index or 0}", environ=env)
        if getattr(result, "should_move_to_execution_device", False):
            result.module.to(device)
        done.append(f"{name}: enable_offload(preset='one_shot_fast', resident budget {gib:.3g} GiB, "
                    f"route {getattr(result, 'route', '?')})")
    return "; ".join(done)


def _mmgp(pipe: Any, device: torch.device, budget: int | None) -> str:
    """mmgp 3.8.2 without quantization, pinned: its per-model budget is in MB and its documented real
    use about twice that, so half the total is asked."""
    if device.type != "cuda":
        raise RuntimeError("mmgp needs a CUDA device")
    from mmgp import offload

    mb = int(budget / 2 / 2**20) if budget else 0
    offload.all(pipe, pinnedMemory=True, quantizeTransformer=False, extraModelsToQuantize=[], budgets=mb,
                asyncTransfers=True, verboseLevel=0)
    return f"mmgp.offload.all(pipe, pinnedMemory=True, quantizeTransformer=False, budgets={mb})"


@dataclass(frozen=True)
class Peer:
    label: str
    attach: Any
    """``(pipe, device, the run's first budget) -> what it called``; raises when it cannot run here."""
    undo: Any = None
    """Takes it off the pipeline again; ``None``: it stays (the last row of a run)."""
    slow: bool = False
    """Runs ``--slow-peer-steps`` steps, its denoise time scaled to the asked steps."""


PEERS: dict[str, Peer] = {
    "model_cpu_offload": Peer("diffusers enable_model_cpu_offload()", _model_cpu_offload, _remove_hooks),
    "sequential_cpu_offload": Peer("diffusers enable_sequential_cpu_offload()", _sequential_cpu_offload,
                                   _remove_hooks, slow=True),
    "group_offload": Peer("diffusers enable_group_offload(block_level, 1 block per group, use_stream)",
                          _group_offload),
    "ddo": Peer("DDO 0.1.0rc2 enable_offload per component (one_shot_fast, offload_pipeline's split)", _ddo),
    "mmgp": Peer("mmgp 3.8.2 offload.all (pinned, no quantization)", _mmgp),
}
"""The peer rows, after ours, in the order asked."""


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

    lines = [f"# A classic FluxPipeline, generation after generation ({doc['machine']})", "",
             f"- date: {doc['date']}; commit: {doc['commit']}; command: `{doc['command']}`",
             "- weights: " + ", ".join(f"{n} {fmt_bytes(b)}" for n, b in doc["weights"].items()),
             *([f"- card: {doc['card_gib']:g} GiB left free for the offloaded rows (a filler tensor, left out of every "
                "peak)"] if doc.get("card_gib") else []),
             f"- call: {json.dumps(doc['call'])}; generations with the prompts {doc['prompts']} in turn, seed 0",
             "- encode = call start to the first denoiser step, denoise = first step to the last, decode = the rest; "
             "the device is synchronised at every step boundary; uploaded = bytes sent to the device in that generation",
             "- peak GPU allocated is PyTorch's counter (it does not see the vmm arena's chunks); arena = the arena's peak "
             "(chunks mapped + what its members keep outside it); driver used = cudaMemGetInfo's used memory, sampled at "
             "step boundaries (the whole device, including the CUDA context); host RAM = the process's RSS once attached less "
             "its RSS with every component resident on the device (both after malloc_trim), and its ratio to the weights",
             "", "| pipeline | budget | gen | total s | encode s | denoise s | decode s | uploaded GB | peak GPU allocated "
             "| arena | driver used | host RAM | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    weights = sum(doc["weights"].values())
    for r in doc["rows"]:
        budget = _label(r["vram_budget"]) if r.get("vram_budget") else "-"
        if r.get("error"):
            lines.append(f"| {r['pipeline']} | {budget} | - | {r['error']} |||||||||")
            continue
        for i, g in enumerate(r["generations"]):
            sent = "-" if g["uploaded_bytes"] is None else f"{g['uploaded_bytes'] / 1e9:.2f}"
            tail = (f"{fmt_bytes(r['peak_gpu_allocated'])} | "
                    f"{fmt_bytes(r['arena_peak_bytes']) if r.get('arena_peak_bytes') else '-'} | "
                    f"{fmt_bytes(r['peak_driver_used']) if r.get('peak_driver_used') else '-'} | "
                    f"{fmt_bytes(r['host_rss_over_baseline'])} ({r['host_rss_over_baseline'] / weights:.2f}x) | "
                    f"{_exact_label(r)}") if i == 0 else "| | | | |"
            lines.append(f"| {r['pipeline'] if i == 0 else ''} | {budget if i == 0 else ''} | {i + 1} | "
                         f"{g['total_s']:.2f} | {g['encode_s']:.2f} | {g['denoise_s']:.2f} | {g['decode_s']:.2f} | "
                         f"{sent} | {tail} |")
    for r in doc["rows"]:
        if r.get("policies"):
            lines += ["", f"{r['pipeline']} at {_label(r['vram_budget'])}: "
                      + "; ".join(f"{n}: {d}" for n, d in r["policies"].items())]
    acts = doc["rows"][0].get("activation_bytes") if doc["rows"] else None
    if acts:
        lines += ["", "Activations of the resident row (PyTorch's peak in the phase less what was allocated at its "
                  "start): " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in acts.items())]
    fit = doc.get("fitted_budget")
    if fit:
        lines += ["", f"Static split fitted to the card (`--budgets auto` for the linear route and the peers): free "
                  f"{fmt_bytes(fit['free_bytes'])} - {fit['largest_phase']} activations "
                  f"{fmt_bytes(fit['activation_bytes'])} - margin {fmt_bytes(fit['margin_bytes'])} = "
                  f"{fmt_bytes(fit['budget_bytes'])}"]
    for r in doc["rows"]:
        for i, g in enumerate(r.get("generations") or []):
            for why in g.get("out_of_memory_before") or []:
                lines += ["", f"{r['pipeline']}, generation {i + 1}: ran out of device memory and ran again (the row's "
                          f"time is the run that finished): {why}"]
    lines += [f"- {line}" for line in gains(doc["rows"])]
    lines += [f"- {line}" for line in against_peers(doc["rows"])]
    return "\n".join(lines) + "\n"


def _exact_label(row: dict[str, Any]) -> str:
    if row["exact"] is None:
        return "- (fewer steps)"
    if row["exact"]:
        return "yes"
    return ("NO: the latents are identical, the decode differs" if row.get("latents_exact")
            else "NO")


def _later(row: dict[str, Any], key: str) -> float:
    """The mean of ``key`` over a row's generations after the first."""
    later = row["generations"][1:]
    return sum(g[key] for g in later) / len(later)


def gains(rows: list[dict[str, Any]]) -> list[str]:
    """Per budget asked, the vmm row against the linear row (same codec suffix): the time per image
    gained in generations 2 onward against the bytes it did not upload over the link (issue target:
    gain >= fewer bytes / link)."""
    out = []
    done = [r for r in rows if not r.get("error") and r.get("generations") and "asked_budget" in r]
    for v in (r for r in done if r["route"].split("+")[0] == "vmm"):
        suffix = v["route"].partition("+")[2]
        lin = next((r for r in done if r["route"] == "+".join(filter(None, ["linear", suffix]))
                    and r["asked_budget"] == v["asked_budget"]), None)
        if lin is None or len(v["generations"]) < 2 or len(lin["generations"]) < 2:
            continue
        gain = _later(lin, "total_s") - _later(v, "total_s")
        fewer = _later(lin, "uploaded_bytes") - _later(v, "uploaded_bytes")
        link = lin.get("link_gb_s") or v.get("link_gb_s")
        ideal = fewer / (link * 1e9) if link else None
        out.append(f"{v['route']} against {lin['route']} at {_label(v['asked_budget'])}, generations 2-"
                   f"{len(v['generations'])}: {_later(lin, 'total_s'):.2f} -> {_later(v, 'total_s'):.2f} s per image "
                   f"(gain {gain:.3f} s); uploaded {_later(lin, 'uploaded_bytes') / 1e9:.1f} -> "
                   f"{_later(v, 'uploaded_bytes') / 1e9:.1f} GB per image"
                   + (f" ({fewer / 1e9:.1f} GB fewer = {ideal:.3f} s at the link's {link:.1f} GB/s); gain / that = "
                      f"{gain / ideal:.2f}" if ideal else ""))
    return out


def _per_image(row: dict[str, Any]) -> float:
    """Seconds per image: the mean of the generations after the first, or the only one."""
    return _later(row, "total_s") if len(row["generations"]) > 1 else row["generations"][0]["total_s"]


def against_peers(rows: list[dict[str, Any]]) -> list[str]:
    """Per peer row, the fastest row of ours whose peak (the driver's used memory, the whole device)
    is at or below the peer's, and how much faster it is per image (issue target: faster than every
    peer at equal or lower peak), or that no row of ours ran that low."""
    done = [r for r in rows if not r.get("error") and r.get("generations") and r.get("peak_driver_used")]
    ours = [r for r in done if r["route"].split("+")[0] in ("linear", "vmm")]
    out = []
    for peer in (r for r in done if r["route"] in PEERS):
        limit, theirs = peer["peak_driver_used"], _per_image(peer)
        fits = [r for r in ours if r["peak_driver_used"] <= limit]
        label = f"{peer['pipeline']} ({theirs:.2f} s per image at {limit / 2**30:.2f} GiB driver-used)"
        if not fits:
            low = min(ours, key=lambda r: r["peak_driver_used"], default=None)
            out.append(f"{label}: no row of ours at or below its peak"
                       + (f" (our lowest: {low['pipeline']} at {_label(low['vram_budget'])}, "
                          f"{low['peak_driver_used'] / 2**30:.2f} GiB)" if low else ""))
            continue
        best = min(fits, key=_per_image)
        out.append(f"{label}: our fastest at or below its peak is {best['pipeline']} at {_label(best['vram_budget'])}, "
                   f"{_per_image(best):.2f} s at {best['peak_driver_used'] / 2**30:.2f} GiB: "
                   f"{theirs / _per_image(best):.2f}x {'faster' if _per_image(best) < theirs else 'as fast or slower'}")
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budgets", default="8,16,24",
                   help="total VRAM budgets (a bare number is GiB; 'auto': the vmm route's Arena('auto')), "
                        "comma-separated")
    p.add_argument("--routes", default="linear,vmm",
                   help="linear (offload_pipeline's default split), vmm (vmm_fast), each with +fixed or +tiered "
                        "for the denoiser's codec (vmm+tiered); peers after them: "
                        "model_cpu_offload, sequential_cpu_offload, and last (they stay on): group_offload, ddo "
                        "or mmgp")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--resolution", type=int, default=1024, help="image height and width (full-size components)")
    p.add_argument("--generations", type=int, default=3, help="generations in a row, each with its own prompt")
    p.add_argument("--slow-peer-steps", type=int, default=2,
                   help="steps run by a slow peer (sequential CPU offload), its denoise scaled to --steps")
    p.add_argument("--card", type=float, default=None,
                   help="GiB left free for the offloaded rows (a smaller card, simulated by a filler tensor that "
                        "the peaks leave out; the resident row runs on the whole card); default: the whole card")
    p.add_argument("--tiny", action="store_true", help="ddo_blocks' tiny components (CPU, tests)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    doc = run(args)
    return write_rows(args.out, "pipeline", doc, markdown(doc))


if __name__ == "__main__":
    raise SystemExit(main())
