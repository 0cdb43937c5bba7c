"""Every environment variable ddo_blocks reads, parsed in one place.

A value that cannot be used is a ``ConfigError`` naming the variable, what it holds and what it
accepts, never a ``ValueError`` from deep inside. ``docs/environment.md`` lists the same table.
"""

from __future__ import annotations

import math
import os

from .errors import ConfigError

VARIABLES: dict[str, str] = {
    "DDO_VRAM_BUDGET": "enable_offload()'s vram_budget when none is passed (without it: 'auto'): bytes or a size "
                       "such as 6GiB",
    "DDO_LINK_GBPS": "host-to-device bandwidth for the planner and the roofline, in decimal GB/s (a positive "
                     "number), instead of the measured one",
    "DDO_DISK_GBPS": "disk read bandwidth for the NVMe route's planner and roofline, in decimal GB/s (a positive "
                     "number), instead of the measured one",
    "DDO_CACHE_DIR": "where the embedded tiny models are written (default: .ddo_cache in the current directory)",
}


def raw(name: str) -> str | None:
    """The variable's value, ``None`` when unset or empty."""
    assert name in VARIABLES, name
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def gbps(name: str) -> float | None:
    """A bandwidth variable in bytes per second, ``None`` when unset.

    Raises:
        ConfigError: not a finite positive number.
    """
    value = raw(name)
    if value is None:
        return None
    try:
        rate = float(value)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(
            f"environment variable {name}={value!r} is not a bandwidth: it takes a positive number of decimal "
            f"GB/s, e.g. {name}=25 ({VARIABLES[name]}); unset it to measure instead"
        )
    return rate * 1e9


def size(name: str) -> int | None:
    """A byte-size variable, ``None`` when unset.

    Raises:
        ConfigError: not a size.
    """
    from .budget import parse_bytes

    value = raw(name)
    if value is None:
        return None
    try:
        return parse_bytes(value, what=name)
    except ConfigError as exc:
        raise ConfigError(f"environment variable {exc} ({VARIABLES[name]}); unset it to pass the value instead") from None
