"""The NVMe route: models larger than RAM, streamed from their safetensors files. The linear route's
scheduler and slots with a file-backed unit store and a static RAM cache
(``streaming.stores.FileStore``); only through ``ddo_blocks.from_pretrained(..., route="nvme")``."""

from __future__ import annotations

from ..budget import parse_bytes
from ..errors import ConfigError
from .spec import Engine, EngineRequest, HostMode, Preset, RouteSpec, refuse_unknown, staging_threads

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
    from ..streaming import StreamingEngine, plan, stores

    units = plan.check_granularity(req.options.pop("units", "auto"))
    ram_budget = parse_bytes(req.options.pop("ram_budget", None), what="ram_budget")
    refuse_unknown("nvme", req.options, ("ram_budget", "units"))
    chosen = SPEC.preset_map["nvme_baseline"] if req.preset == "auto" else SPEC.preset_map[req.preset]
    if req.loader is None:
        raise ConfigError(
            f"route='nvme' streams weights from the model's safetensors files, and this {type(req.module).__name__} "
            "is already loaded (its files are unknown); load it with ddo_blocks.from_pretrained(ModelClass, path, "
            "route='nvme', ram_budget=..., vram_budget=..., device=...), or use route='linear' for a module in RAM"
        )

    def store(engine: StreamingEngine) -> stores.FileStore:
        return stores.FileStore(engine, ram_budget=ram_budget, ram_auto=req.preset == "auto")

    return chosen, StreamingEngine(req.module, chosen, req.budget, req.device, measured=req.measured, store=store, loader=req.loader,
                                   units=units)


SPEC = RouteSpec(
    name="nvme",
    summary="stream from the safetensors files with a static RAM cache (from_pretrained only)",
    presets=PRESETS,
    factory=factory,
    options=("ram_budget", "units"),
    auto_summary="nvme_baseline with ram_budget (unless given) = half the available RAM, at most the streamed bytes",
    streams=True,
    reads_files=True,
    needs_files=True,
)
SPECS = (SPEC,)
