"""Which quantized weight formats a streaming route can carry, checked before any weight moves.

A streamed unit is packed into host slabs and copied into slots as bytes, its parameters pointed at
views of them. That carries every tensor with a plain storage: ordinary dtypes, SDNQ's packed
layers (``routes/sdnq.py``) and diffusers' ``GGUFParameter`` (its bytes are the GGUF blocks, its
quantization type an attribute of the parameter, dequantized by the layer at each call). It does not
carry tensor subclasses whose values live in inner tensors (torchao's ``AffineQuantizedTensor`` and
float8 / int8 weight-only tensors, optimum-quanto's ``QTensor``: they have no storage of their own),
nor bitsandbytes' parameters (their quantization state lives beside the bytes; not tried): those are
refused with a ``ConfigError`` naming the format and what works.
"""

from __future__ import annotations

from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import ConfigError

_FAMILIES = (("torchao", "torchao"), ("optimum.quanto", "optimum-quanto"), ("bitsandbytes", "bitsandbytes"))


def _family(t: object) -> str | None:
    module = type(t).__module__ or ""
    return next((name for prefix, name in _FAMILIES if module.startswith(prefix)), None)


def check_streamable(module: nn.Module, route: str) -> None:
    """Raises ``ConfigError`` for the first parameter of ``module`` a streaming route cannot carry (a
    format above, or an inference tensor)."""
    for name, p in module.named_parameters():
        if p.is_inference():
            raise ConfigError(
                f"{name} of {type(module).__name__} is an inference tensor (the module was built or loaded under "
                f"torch.inference_mode()); route={route!r} points parameters at slots and host slabs, which "
                "inference tensors do not allow. Build or load the module outside torch.inference_mode() (calling "
                "it under inference_mode is fine), or use route='resident'"
            )
        family = _family(p)
        if family is None and not is_traceable_wrapper_subclass(p):
            continue
        raise ConfigError(
            f"{name} of {type(module).__name__} is a quantized {type(p).__name__} ({family or 'a tensor subclass'}, "
            f"{p.dtype}, {tuple(p.shape)}); route={route!r} streams weights as plain bytes and cannot carry "
            "a quantized tensor whose values live in inner tensors. What works: route='resident' (the whole "
            "component on the GPU while it runs), "
            "an SDNQ- or GGUF-quantized checkpoint (streamed packed), or the unquantized weights"
        )
