"""The exception hierarchy of ddo_blocks (declared in the Rust extension, re-exported here).

Every error names what was asked, what was found and what would work:

- ``DdoError``: base class.
- ``ConfigError``: an unknown route, preset, option, or a malformed value (also a ``ValueError``
  in spirit: catch ``DdoError`` or the specific class).
- ``PlanError`` / ``BudgetError``: the component cannot be placed as asked (budget too small).
- ``CudaError`` / ``CudaNotAvailableError`` / ``OffloadMemoryError``: driver failures, no driver,
  out of GPU or page-locked memory during setup.
- ``CheckpointError``: a safetensors file or index is missing, truncated or corrupt.
- ``OffloadStateError``: offloading a module twice, removing twice, removing while running.
"""

from ._native import (
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

__all__ = [
    "BudgetError",
    "CheckpointError",
    "ConfigError",
    "CudaError",
    "CudaNotAvailableError",
    "DdoError",
    "OffloadMemoryError",
    "OffloadStateError",
    "PlanError",
]
