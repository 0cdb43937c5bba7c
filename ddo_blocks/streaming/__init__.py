"""Streaming a component's weights through device slots: the engine and its parts (see
``engine.py`` for how they compose). The linear, nvme and sdnq routes build a
:class:`StreamingEngine` with their own unit store."""

from .engine import StreamingEngine

__all__ = ["StreamingEngine"]
