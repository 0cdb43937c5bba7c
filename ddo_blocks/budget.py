"""Byte sizes as users write them: ``6GiB``, ``512 MiB``, ``1.5GB``, ``0``, or a plain int."""

from __future__ import annotations

import math
import re

from .errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: float | str | None, *, what: str = "vram_budget") -> int | None:
    """Parses a byte size. ``None`` stays ``None`` (no limit).

    Args:
        value: bytes as an int, or a string such as ``"6GiB"``, ``"512MiB"``, ``"1.5GB"``.
        what: the argument's name, for the error message.

    Returns:
        The size in bytes, or ``None``.

    Raises:
        ConfigError: the value is negative, not a number or has an unknown unit.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} is not a size; pass bytes (int) or a string such as '6GiB'")
    if isinstance(value, (int, float)):
        if value < 0 or math.isnan(value):
            raise ConfigError(f"{what}={value!r} must be a non-negative number of bytes")
        return _bounded(value, value, what)
    if isinstance(value, str):
        m = _PATTERN.match(value)
        if m:
            unit = m.group(2).lower()
            if unit in _UNITS:
                return _bounded(float(m.group(1)) * _UNITS[unit], value, what)
        raise ConfigError(
            f"{what}={value!r} is not a size; use bytes or a number with a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '6GiB'"
        )
    raise ConfigError(f"{what} must be an int or a string such as '6GiB', got {type(value).__name__}")


MAX_BYTES = 2**63 - 1
"""The largest size accepted: far above any machine, and what every layer below can represent."""


def _bounded(n: float, given: object, what: str) -> int:
    if not math.isfinite(n) or n > MAX_BYTES:
        raise ConfigError(
            f"{what}={given!r} is larger than any machine's memory (the limit is 2**63-1 bytes); pass the "
            "budget in bytes or a size such as '6GiB', or None for no limit"
        )
    return int(n)


def fmt_bytes(n: float | None) -> str:
    """Formats bytes for people: ``1.50 GiB``."""
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
