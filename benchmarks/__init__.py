"""The ddo-blocks benchmark harness: ``python -m benchmarks.run`` (see benchmarks/README.md).

Importing this package never imports torch (the result/merge code must stay light). It does one
thing first: on the GPU machine the project tree is copied without the built extension
(``ddo_blocks/_native*.so`` is git-ignored) while the wheel is installed elsewhere (``/tmp/site``).
Running ``python -m benchmarks.run`` from the project root would then import the source tree's
``ddo_blocks`` (no extension) ahead of the installed one. When that is the case, the entries that
hold a built ``ddo_blocks`` are moved in front of the project root on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _has_native(pkg: Path) -> bool:
    return any(pkg.glob("_native*.so")) or any(pkg.glob("_native*.pyd"))


def _prefer_built_ddo_blocks() -> None:
    local = ROOT / "ddo_blocks"
    if not local.is_dir() or _has_native(local):
        return
    built = []
    for entry in sys.path:
        try:
            base = Path(entry or ".").resolve()
        except OSError:
            continue
        if base != ROOT and _has_native(base / "ddo_blocks"):
            built.append(entry)
    if built:
        sys.path[:] = built + [e for e in sys.path if e not in built]


_prefer_built_ddo_blocks()
