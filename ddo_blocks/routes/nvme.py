"""The NVMe route: models larger than RAM, streamed from their safetensors files. The linear route's
scheduler and slots with a file-backed unit store and a static RAM cache
(``streaming.stores.FileStore``); only through ``ddo_blocks.from_pretrained(..., route="nvme")``.

``codec="fixed"|"tiered"|"huffman"|"lossless"`` reads the disk units from a coded side file next to
the checkpoint instead (``streaming.sidefile``: written at the first attach, found at the next), about
0.67-0.75x of the bytes per call, decoded on the GPU into the slot; ``codec_dir`` puts the side file
elsewhere (a read-only checkpoint directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..budget import parse_bytes
from ..errors import ConfigError
from .spec import Engine, EngineRequest, HostMode, Preset, RouteSpec, refuse_unknown, staging_threads
from .values import check_values

OPTIONS = ("ram_budget", "units", "codec", "codec_dir")

PRESETS = (
    Preset(
        "nvme",
        "nvme_baseline",
        "models larger than RAM (from_pretrained only): streamed units are read from the safetensors "
        "files every call (O_DIRECT where possible) through a 4 x 64 MiB pinned ring; a static RAM "
        "cache of ram_budget bytes (default 0; auto: what available RAM allows) keeps some units",
        HostMode.DISK_STAGED,
        staging_buffers=4,
        staging_buffer_mib=64,
        staging_threads=staging_threads(),
        host_ram_ratio="ram_budget + 256 MiB",
    ),
)


def factory(req: EngineRequest) -> tuple[Preset, Engine]:
    from ..streaming import StreamingEngine, coded, plan, sidefile, stores

    units = plan.check_granularity(req.options.pop("units", "auto"))
    ram_budget = parse_bytes(req.options.pop("ram_budget", None), what="ram_budget")
    codec = req.options.pop("codec", "off")
    codec_dir = req.options.pop("codec_dir", None)
    refuse_unknown("nvme", req.options, OPTIONS)
    if not isinstance(codec, str) or codec not in ("off", *coded.CODES, "lossless"):
        raise ConfigError(f"codec={codec!r} is not a codec of the NVMe route; use 'off', "
                          f"{', '.join(map(repr, coded.CODES))} or 'lossless'")
    if codec_dir is not None and not Path(codec_dir).is_dir():
        raise ConfigError(f"codec_dir={codec_dir!r} is not a directory; pass an existing writable directory for the "
                          "coded side file, or leave it out (next to the checkpoint)")
    chosen = SPEC.preset_map["nvme_baseline"] if req.preset == "auto" else SPEC.preset_map[req.preset]
    if req.loader is None:
        raise ConfigError(
            f"route='nvme' streams weights from the model's safetensors files, and this {type(req.module).__name__} "
            "is already loaded (its files are unknown); load it with ddo_blocks.from_pretrained(ModelClass, path, "
            "route='nvme', ram_budget=..., vram_budget=..., device=...), or use route='linear' for a module in RAM"
        )

    code = sidefile.nvme_codec(codec, req.device) if codec != "off" else "off"
    reserve = sidefile.reserve_bytes(req.module, code, req.device)

    def store(engine: StreamingEngine) -> stores.FileStore:
        return stores.FileStore(engine, ram_budget=ram_budget, ram_auto=req.preset == "auto", codec=code,
                                codec_dir=Path(codec_dir) if codec_dir is not None else None, staged_reserve=reserve,
                                requested_codec=codec)

    return chosen, StreamingEngine(req.module, chosen, req.budget, req.device, measured=req.measured, store=store, loader=req.loader,
                                   units=units, reserve_bytes=reserve)


def option_values(options: dict[str, Any]) -> None:
    """The options' values, before anything moves (``routes/values.py``)."""
    from ..streaming.coded import CODES

    check_values("nvme", options, codecs=("off", *CODES, "lossless"))


def check(module: Any = None, budget: Any = None, device: Any = None, *, options: dict[str, Any] | None = None,
          **_: Any) -> None:
    option_values(options or {})


def codec_reserve(module: Any, options: dict[str, Any], device: torch.device) -> int:
    """Device bytes beside the slots for ``vram_budget="min"`` and ``"auto"``: the coded reads' staging
    buffer."""
    from ..streaming import sidefile

    codec = options.get("codec", "off")
    return sidefile.reserve_bytes(module, sidefile.nvme_codec(codec, device), device) if codec != "off" else 0


SPEC = RouteSpec(
    name="nvme",
    summary="stream from the safetensors files with a static RAM cache (from_pretrained only)",
    presets=PRESETS,
    factory=factory,
    options=OPTIONS,
    codec_reserve=codec_reserve,
    check=check,
    option_values=option_values,
    auto_summary="nvme_baseline with ram_budget (unless given) = half the available RAM, at most the streamed bytes",
    streams=True,
    reads_files=True,
    needs_files=True,
)
SPECS = (SPEC,)
