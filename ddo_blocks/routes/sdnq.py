"""The SDNQ packed route: stream a model quantized with SDNQ (SD.Next's quantization engine) without
touching its math.

SDNQ is GPL-3.0-only and this package is Apache-2.0, so nothing here imports it or copies from it:
an SDNQ layer is recognised by what it is (a module with an ``sdnq_dequantizer`` describing its
packing, a ``forward_func`` and its tensors as parameters: the packed ``weight``, ``scale``,
``zero_point``, ``svd_up``/``svd_down``, ``bias``). The streaming engine moves those parameters as
opaque bytes with their own dtype, shape and strides (int8/fp8 weights are kept transposed when
SDNQ's quantized matmul is on) at 256-byte aligned offsets; it never dequantizes, never replaces
``forward_func`` or the dequantizer, and never calls ``module.to()``. So the layers compute exactly
what they compute resident, and the link carries the packed bytes (int8 about half of bf16, uint4
about 0.3x).

``route="linear", preset="auto"`` picks this route for a component that holds SDNQ layers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .spec import Engine, EngineRequest, HostMode, Preset, RouteSpec, refuse_unknown, staging_threads
from .values import check_values

SUPPORTED_KINDS = ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")
"""The layer kinds (``sdnq_dequantizer.layer_class_name``) whose tensors are all parameters."""


def is_sdnq_layer(module: nn.Module) -> bool:
    """Whether ``module`` is an SDNQ layer (duck typing: no import of sdnq)."""
    return getattr(module, "sdnq_dequantizer", None) is not None and callable(getattr(module, "forward_func", None))


def sdnq_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in module.named_modules() if is_sdnq_layer(m)]


def _unsupported(name: str, layer: nn.Module) -> str | None:
    kind = getattr(layer.sdnq_dequantizer, "layer_class_name", None)
    if kind not in SUPPORTED_KINDS:
        return f"{name} is an SDNQ layer of kind {kind!r}"
    registered = set(layer._parameters) | set(layer._buffers)
    loose = [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor) and k not in registered]
    loose += [f"sdnq_dequantizer.{k}" for k, v in vars(layer.sdnq_dequantizer).items() if isinstance(v, torch.Tensor)]
    if loose:
        return f"{name} holds tensors outside its parameters ({', '.join(loose)}), which streaming would not move"
    return None


def describe_layers(layers: list[tuple[str, nn.Module]]) -> dict[str, int]:
    """``{"int8 Linear": 45, ...}``: the packed weight formats found."""
    return dict(Counter(f"{getattr(m.sdnq_dequantizer, 'weights_dtype', '?')} "
                        f"{getattr(m.sdnq_dequantizer, 'layer_class_name', '?')}" for _, m in layers))


def option_values(options: dict[str, Any]) -> None:
    """The options' values, before anything moves (``routes/values.py``)."""
    check_values("sdnq", options)


def check(module: nn.Module | None = None, budget: int | None = None, device: torch.device | None = None,
          **_: Any) -> None:
    """Refuses, before anything moves, a component without SDNQ layers or with packed layers of a
    kind this route does not carry (naming what it does carry); the module is left untouched."""
    option_values(_.get("options") or {})
    if module is None:
        return
    layers = sdnq_layers(module)
    if not layers:
        raise ConfigError(
            f"route='sdnq' streams SDNQ-quantized layers, and {type(module).__name__} holds none (no module with an "
            "sdnq_dequantizer); quantize it with SDNQ first (e.g. sdnq_post_load_quant, or diffusers' SDNQConfig "
            "when loading), or use route='linear' for an unquantized model"
        )
    bad = [why for name, layer in layers if (why := _unsupported(name, layer)) is not None]
    if bad:
        shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ConfigError(
            f"route='sdnq' cannot stream {type(module).__name__} exactly: {shown}. It carries SDNQ layers of the "
            f"kinds {', '.join(SUPPORTED_KINDS)} whose tensors are all parameters; keep the others resident "
            "(modules_to_not_convert when quantizing) or use route='resident'"
        )


def dense_bytes(layer: nn.Module) -> int:
    """The bytes an SDNQ layer computes with: its weight dequantized (``original_shape`` in
    ``result_dtype``, as its dequantizer describes it), plus its other parameters as stored. The
    planner's compute estimate before the first call measures it; the packed bytes would make a
    compute-bound model look transfer-bound."""
    deq = layer.sdnq_dequantizer
    shape, dtype = getattr(deq, "original_shape", None), getattr(deq, "result_dtype", None)
    weight = getattr(layer, "weight", None)
    if shape is None or not isinstance(dtype, torch.dtype) or weight is None:
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False))
    rest = sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "weight")
    return int(torch.Size(shape).numel()) * dtype.itemsize + rest


def unit_compute_bytes(units: list[Any]) -> list[int]:
    """Per unit, its dense bytes: SDNQ layers dequantized, the other parameters as stored."""
    out = []
    for unit in units:
        packed = {id(p) for m in unit.module.modules() if is_sdnq_layer(m) for p in m.parameters(recurse=False)}
        dense = sum(dense_bytes(m) for m in unit.module.modules() if is_sdnq_layer(m))
        out.append(dense + sum(p.numel() * p.element_size() for _, p in unit.params if id(p) not in packed))
    return out


def report_fields(layers: list[tuple[str, nn.Module]]) -> dict[str, dict[str, Any]]:
    """The packed layers, for the report's plan section."""
    packed = sum(p.numel() * p.element_size() for _, m in layers for p in m.parameters(recurse=False))
    return {"plan": {"sdnq_layers": ", ".join(f"{k}: {n}" for k, n in describe_layers(layers).items()),
                     "sdnq_packed_bytes": packed}}


def factory(req: EngineRequest) -> tuple[Preset, Engine]:
    from ..streaming import StreamingEngine, plan, stores

    units = plan.check_granularity(req.options.pop("units", "auto"))
    refuse_unknown("sdnq", req.options, ("units",))
    check(req.module)
    if req.preset == "auto":  # as the linear route's auto: no page-locking under WSL or past half the RAM
        import psutil

        from . import linear

        packed = sum(p.numel() * p.element_size() for p in req.module.parameters())
        pinned = linear.auto(packed, psutil.virtual_memory().total).host is HostMode.PINNED_SLABS
        chosen = SPEC.preset_map["sdnq" if pinned else "sdnq_low_ram"]
    else:
        chosen = SPEC.preset_map[req.preset]
    fields = report_fields(sdnq_layers(req.module))
    return chosen, StreamingEngine(req.module, chosen, req.budget, req.device, measured=req.measured, store=stores.HostSlabs,
                                   loader=req.loader, units=units, compute_bytes=unit_compute_bytes,
                                   extra_sections=lambda: fields)


PRESETS = (
    Preset("sdnq", "sdnq",
           "SDNQ-quantized layers streamed packed (int8, uint4, fp8 weights with their scales as stored): pinned "
           "exact-size slabs, one async copy per unit; the layers' own forward computes on the device",
           HostMode.PINNED_SLABS, host_ram_ratio="1.0x packed weights"),
    Preset("sdnq", "sdnq_low_ram",
           "as sdnq, with pageable slabs through a 4 x 32 MiB pinned staging ring filled in 1 MiB pieces (no "
           "pinned copy of the weights)",
           HostMode.PAGEABLE_STAGED, staging_buffers=4, staging_buffer_mib=32, staging_threads=staging_threads(),
           staging_piece_kib=1024, host_ram_ratio="1.0x packed + 128 MiB"),
)

SPEC = RouteSpec(
    name="sdnq",
    summary="stream SDNQ-quantized layers packed, their math untouched",
    presets=PRESETS,
    factory=factory,
    options=("units",),
    streams=True,
    device_hook=True,
    releasable=True,
    check=check,
    option_values=option_values,
    claims=lambda module: bool(sdnq_layers(module)),
    claims_auto_of="linear",
)
SPECS = (SPEC,)
