"""Modular Diffusers blocks that place each component of a stage with its own route, preset and
VRAM budget, and report what they did.

- :class:`OffloadBlock` wraps any stage; :class:`TextEncoderBlock`, :class:`DenoiseBlock` and
  :class:`DecodeBlock` are its named forms with the stages' defaults.
- :func:`wrap` wraps a whole preset (``FluxAutoBlocks()``, ``WanBlocks()``, ...) in one call.
- :class:`OffloadPolicy` is the frozen per-component policy; :func:`default_policy` gives the defaults.

See ``docs/blocks.md``.
"""

from ..execution_device import ExecutionDeviceHook
from .block import (
    REPORTS_KEY,
    DecodeBlock,
    DenoiseBlock,
    OffloadBlock,
    TextEncoderBlock,
    module_components,
    remove_offload,
    validate,
)
from .policy import PIPELINE_PRESETS, OffloadPolicy, default_policy, parse_stage_policy
from .wrap import wrap

__all__ = [
    "PIPELINE_PRESETS",
    "REPORTS_KEY",
    "DecodeBlock",
    "DenoiseBlock",
    "ExecutionDeviceHook",
    "OffloadBlock",
    "OffloadPolicy",
    "TextEncoderBlock",
    "default_policy",
    "module_components",
    "validate",
    "parse_stage_policy",
    "remove_offload",
    "wrap",
]
