"""ddo_blocks: weight offloading for low-VRAM diffusion inference, with a Rust core.

Quick start::

    import ddo_blocks
    handle = ddo_blocks.offload(transformer, route="linear", preset="auto", vram_budget="6GiB")
    out = transformer(**inputs)          # runs within the budget, same output as resident
    print(handle.report())
    handle.remove()                      # restores the module exactly
"""

import logging as _logging

from . import presets, routes
from ._native import __version__
from .api import (
    OffloadHandle,
    OffloadResult,
    enable_offload,
    get_handle,
    minimum_budget,
    offload,
    resolve_device,
)
from .budget import fmt_bytes, parse_bytes
from .errors import (
    BudgetError,
    CheckpointError,
    ConfigError,
    CudaError,
    CudaNotAvailableError,
    DdoError,
    OffloadMemoryError,
    OffloadStateError,
    PlanError,
)
from .loading import from_pretrained
from .pipeline import PipelineOffload, offload_pipeline
from .report import Report
from .share import replica, share_weights
from .streaming.arena import Arena
from .streaming.slabs import release_warm_slabs, warm_bytes

_logging.getLogger(__name__).addHandler(_logging.NullHandler())  # silent unless the application configures logging


def __getattr__(name: str):
    # The blocks import diffusers' Modular Pipelines: loaded on first use, not with the package.
    if name in ("wrap", "blocks", "OffloadPolicy", "OffloadBlock"):
        import importlib

        blocks = importlib.import_module(".blocks", __name__)
        return blocks if name == "blocks" else getattr(blocks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Arena",
    "BudgetError",
    "CheckpointError",
    "ConfigError",
    "CudaError",
    "CudaNotAvailableError",
    "DdoError",
    "OffloadBlock",
    "OffloadHandle",
    "OffloadMemoryError",
    "OffloadPolicy",
    "OffloadResult",
    "OffloadStateError",
    "PipelineOffload",
    "PlanError",
    "Report",
    "__version__",
    "enable_offload",
    "fmt_bytes",
    "from_pretrained",
    "get_handle",
    "minimum_budget",
    "offload",
    "offload_pipeline",
    "parse_bytes",
    "presets",
    "routes",
    "share_weights",
    "release_warm_slabs",
    "replica",
    "resolve_device",
    "warm_bytes",
    "wrap",
]
