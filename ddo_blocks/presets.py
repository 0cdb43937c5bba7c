"""Presets: small frozen value objects, one per policy of a route. The registry of routes and their
presets is ``ddo_blocks.routes``; this module keeps the names users and older code import.
``python -m ddo_blocks presets`` prints the table."""

from __future__ import annotations

from .routes import REGISTRY, describe, resolve
from .routes.linear import is_wsl
from .routes.spec import HostMode, Preset

ROUTES: dict[str, dict[str, Preset]] = {r: dict(spec.preset_map) for r, spec in REGISTRY.items()}
"""``{route: {preset name: Preset}}``, read from the registry."""


__all__ = ["ROUTES", "HostMode", "Preset", "describe", "is_wsl", "resolve"]
