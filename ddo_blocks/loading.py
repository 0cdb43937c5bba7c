"""Fast loading: a model built on the meta device whose weights are read from safetensors files
straight into their final place (pinned slabs for streamed units, the device for resident ones),
in parallel, with positional reads and a progress bar, never holding a second copy in RAM.

``from_pretrained(FluxTransformer2DModel, "/models/flux", subfolder="transformer", vram_budget="8GiB")``
returns the same :class:`~ddo_blocks.api.OffloadHandle` as ``offload()``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _native
from .errors import CheckpointError, ConfigError
from .streaming.upload import STAGING_BYTES, staged_upload

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_FILE_DTYPE = {v: k for k, v in _DTYPES.items()}
_WEIGHT_NAMES = ("diffusion_pytorch_model", "model")


def same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether a tensor stored as ``a`` may be loaded into one of ``b`` (a float stored as another
    float width is cast, as diffusers does; a float stored as an integer, or the reverse, is not)."""
    return a.is_floating_point == b.is_floating_point and a.is_complex == b.is_complex


@dataclass(frozen=True)
class TensorSource:
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """Maps each tensor name to the safetensors file that holds it (single file or sharded)."""
    for stem in _WEIGHT_NAMES:
        index = directory / f"{stem}.safetensors.index.json"
        if index.is_file():
            weight_map = _native.read_shard_index(index)
            files = {}
            for name, shard in weight_map.items():
                shard_path = directory / shard
                if not shard_path.is_file():
                    raise CheckpointError(
                        f"shard {shard} listed in {index} for tensor {name!r} is missing from {directory}"
                    )
                files[name] = shard_path
            return files
        single = directory / f"{stem}.safetensors"
        if single.is_file():
            return {"": single}
    found = sorted(p.name for p in directory.glob("*.safetensors*"))
    raise CheckpointError(
        f"no safetensors weights in {directory}: expected diffusion_pytorch_model.safetensors, model.safetensors "
        f"or a *.safetensors.index.json (found: {', '.join(found) or 'nothing'})"
    )


class Checkpoint:
    """Every tensor of a (possibly sharded) safetensors checkpoint, validated."""

    def __init__(self, directory: Path):
        self.directory = directory
        files = checkpoint_files(directory)
        self.indexes = {p: _native.SafetensorsIndex(p) for p in sorted(set(files.values()))}
        self.tensors: dict[str, TensorSource] = {}
        for path, idx in self.indexes.items():
            for name, dtype, shape, offset, nbytes in idx.tensors():
                if "" not in files and files.get(name) != path:
                    continue  # a shard holding a tensor the index assigns elsewhere
                if dtype not in _DTYPES:
                    raise CheckpointError(f"{path.name}: tensor {name!r} has dtype {dtype}, which ddo_blocks cannot load")
                self.tensors[name] = TensorSource(path, offset, nbytes, _DTYPES[dtype], tuple(shape))
        missing_in_shards = [n for n in files if n and n not in self.tensors]
        if missing_in_shards:
            raise CheckpointError(
                f"the shard index of {directory} lists tensors its shards do not hold: {_names(missing_in_shards)}"
            )

    def check_unchanged(self) -> None:
        for idx in self.indexes.values():
            idx.check_unchanged()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class Loader:
    """Matches a meta-device model to a checkpoint and fills its tensors wherever the engine puts them."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint, progress: bool = True):
        self.checkpoint = checkpoint
        self.sources: dict[int, TensorSource] = {}
        unexpected = set(checkpoint.tensors)
        missing: list[str] = []
        names_of: dict[int, list[str]] = defaultdict(list)
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of[id(p)].append(name)
        tensors = {id(p): p for p in model.parameters()}
        persistent = dict(model.state_dict(keep_vars=True))
        for name, b in model.named_buffers():
            if name in persistent and name in checkpoint.tensors:
                names_of[id(b)].append(name)
                tensors[id(b)] = b
        for key, names in names_of.items():
            hit = next((n for n in names if n in checkpoint.tensors), None)
            unexpected.difference_update(names)
            if hit is None:
                missing.append(names[0])
                continue
            src, t = checkpoint.tensors[hit], tensors[key]
            if tuple(t.shape) != src.shape:
                raise CheckpointError(
                    f"{src.path.name}: tensor {hit!r} has shape {list(src.shape)} but the model expects "
                    f"{list(t.shape)}; the checkpoint does not match this model's config"
                )
            if not same_kind(src.dtype, t.dtype):
                raise CheckpointError(
                    f"{src.path}: tensor {hit!r} is stored as {_FILE_DTYPE[src.dtype]} ({src.dtype}) but the model "
                    f"expects {t.dtype}; a {'float' if t.dtype.is_floating_point else 'non-float'} tensor cannot be "
                    "read from a file that stores it otherwise: the file is corrupt or belongs to another model"
                )
            self.sources[key] = src
        if missing:
            raise CheckpointError(f"{checkpoint.directory}: the checkpoint lacks tensors the model needs: {_names(missing)}")
        if unexpected:
            raise CheckpointError(
                f"{checkpoint.directory}: the checkpoint holds tensors this model does not have: "
                f"{_names(sorted(unexpected))}; is this the right model class or subfolder?"
            )
        self._pending = set(self.sources)
        self.bytes_read = 0
        self._bar: Any = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=checkpoint.nbytes, unit="B", unit_scale=True, desc=f"loading {checkpoint.directory.name}",
                             leave=False)

    def source(self, t: torch.Tensor) -> TensorSource | None:
        return self.sources.get(id(t))

    def pending(self, t: torch.Tensor) -> bool:
        """Whether ``t`` still waits for its values from the checkpoint."""
        return id(t) in self._pending

    def take(self, t: torch.Tensor) -> TensorSource:
        """The source of ``t``, marking it as filled by the caller."""
        self._pending.discard(id(t))
        return self.sources[id(t)]

    def _advance(self, n: int) -> None:
        self.bytes_read += n
        if self._bar is not None:
            self._bar.update(n)

    def read_many(self, pairs: list[tuple[TensorSource, torch.Tensor]]) -> None:
        """Fills host tensors (contiguous, same dtype) from their sources: positional reads in
        parallel, grouped by file. Other destinations go through ``fill``."""
        by_file: dict[Path, list[tuple[int, int, int]]] = defaultdict(list)
        for src, dst in pairs:
            if dst.device.type == "cpu" and dst.dtype == src.dtype and dst.is_contiguous():
                by_file[src.path].append((src.offset, src.nbytes, dst.data_ptr()))
            else:
                self.fill(src, dst)
        for path, jobs in by_file.items():
            _native.read_file_into(path, jobs)
            self._advance(sum(n for _, n, _ in jobs))

    def fill(self, src: TensorSource, dst: torch.Tensor) -> None:
        """Reads one tensor into ``dst`` on any device, casting when the dtypes differ."""
        tmp = torch.empty(src.shape, dtype=src.dtype)
        _native.read_file_into(src.path, [(src.offset, src.nbytes, tmp.data_ptr())])
        dst.copy_(tmp)
        self._advance(src.nbytes)

    def materialize(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A tensor on ``device`` with the checkpoint's values for the pending tensor ``t``."""
        src = self.take(t)
        out = t.data if device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, device=device)
        self.read_many([(src, out)])
        return out

    def materialize_many(
        self, tensors: list[torch.Tensor], device: torch.device, *, pinned: bool = True
    ) -> list[torch.Tensor]:
        """Like :meth:`materialize` for many tensors. For a GPU with ``pinned``, the files are read in
        parallel into two page-locked staging buffers in turn while the other one's upload runs,
        instead of pageable tensor-by-tensor copies (about 6 GB/s); without it (presets that promise
        no large page-locked regions) each tensor goes through pageable memory."""
        if device.type != "cuda":
            return [self.materialize(t, device) for t in tensors]
        outs = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors]
        batch: list[tuple[TensorSource, torch.Tensor]] = []
        for t, out in zip(tensors, outs):
            src = self.take(t)
            if not pinned or src.dtype != t.dtype or src.nbytes > STAGING_BYTES:
                self.fill(src, out)  # pageable: asked for, casts, or too big for the staging buffer
            else:
                batch.append((src, out))
        staged_upload(batch, device, lambda src: src.nbytes, self.read_many)
        return outs

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def config_dtype(directory: Path) -> torch.dtype | None:
    """The ``torch_dtype`` (or ``dtype``) the directory's config.json names, if any."""
    cfg = json.loads((directory / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    return getattr(torch, name) if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) else None


def build_on_meta(model_class: type, directory: Path, dtype: torch.dtype | None) -> nn.Module:
    """Builds ``model_class`` from the directory's config with parameters on the meta device
    (buffers stay real: non-persistent ones are computed in ``__init__`` and not in checkpoints),
    cast to ``dtype`` when given (with the class's float32 modules kept in float32)."""
    from accelerate import init_empty_weights

    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json; pass the model directory (and subfolder=)")
    with init_empty_weights(include_buffers=False):
        if hasattr(model_class, "load_config") and hasattr(model_class, "from_config"):
            model = model_class.from_config(model_class.load_config(directory))
        elif hasattr(model_class, "config_class"):
            model = model_class(model_class.config_class.from_pretrained(directory))
        else:
            raise ConfigError(
                f"{model_class.__name__} is neither a diffusers model (load_config/from_config) nor a "
                "transformers model (config_class); build it yourself and call ddo_blocks.offload()"
            )
    if dtype is not None:
        # As diffusers' loader: modules the class keeps in float32 stay there under fp16/bf16.
        keep = list(getattr(model_class, "_keep_in_fp32_modules", None) or [])
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            if dtype in (torch.float16, torch.bfloat16) and any(k in name.split(".") for k in keep):
                p.data = p.data.to(torch.float32)
            else:
                p.data = p.data.to(dtype)
    return model.eval()


def unmeta(model: nn.Module) -> None:
    """Gives every meta parameter an uninitialised CPU tensor (new ``Parameter`` objects, tying kept).

    ``torch.empty`` only reserves address space: pages are charged to the process when written, and
    a parameter whose bytes go straight into a slab or onto the GPU never touches its placeholder.
    """
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]


def quantization_method(directory: Path) -> str | None:
    """The ``quant_method`` of the directory's ``config.json`` ``quantization_config`` (``"sdnq"``, ...)."""
    config = directory / "config.json"
    if not config.is_file():
        return None
    try:
        quant = json.loads(config.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError):
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return str(method) if method is not None else None


def _from_quantized(model_class: type, directory: Path, *, route: str, preset: str, dtype: torch.dtype | None,
                    **kwargs: Any):
    """A quantized checkpoint: its layers are made by the model library's own loader (diffusers' SDNQ
    quantizer, which needs ``sdnq`` installed), then offloaded; the packed tensors are read once."""
    from .api import offload

    method = quantization_method(directory)
    if method != "sdnq":
        raise ConfigError(
            f"{directory} is quantized with {method!r}; ddo_blocks streams SDNQ-quantized models (route='sdnq'). "
            "Load it with its library and offload() the module with route='resident' or route='off'"
        )
    load_kwargs: dict[str, Any] = {"local_files_only": True}
    if dtype is None:  # the config's, else the dtype of most of the file's floating-point bytes (not float32 by default)
        dtype = config_dtype(directory)
    if dtype is None:
        by_dtype: dict[torch.dtype, int] = defaultdict(int)
        for t in Checkpoint(directory).tensors.values():
            if t.dtype.is_floating_point and t.dtype.itemsize >= 2:
                by_dtype[t.dtype] += t.nbytes
        dtype = max(by_dtype, key=by_dtype.__getitem__) if by_dtype else None
    if dtype is not None:
        load_kwargs["torch_dtype"] = dtype
    try:
        model = model_class.from_pretrained(directory, **load_kwargs)
    except ImportError as exc:
        raise ConfigError(
            f"{directory} is SDNQ-quantized, and loading it needs the sdnq package (GPL-3.0, not a dependency of "
            f"ddo_blocks): pip install sdnq ({exc})"
        ) from exc
    return offload(model.eval(), route=route, preset=preset, **kwargs)


def from_pretrained(
    model_class: type,
    path: str | Path,
    *,
    route: str = "linear",
    preset: str = "auto",
    vram_budget: int | str | None = None,
    device: str | torch.device = "cuda",
    subfolder: str | None = None,
    dtype: torch.dtype | None = None,
    component: str | None = None,
    progress: bool = True,
    **options: Any,
):
    """Builds ``model_class`` from a Diffusers/Transformers model directory and loads its safetensors
    weights straight into the offload's memory.

    Args:
        model_class: e.g. ``diffusers.FluxTransformer2DModel``.
        path: the model directory (or a pipeline directory together with ``subfolder``).
        route, preset, vram_budget, device, component, **options: as for :func:`ddo_blocks.offload`.
        subfolder: e.g. ``"transformer"`` inside a pipeline directory.
        dtype: the parameters' dtype (default: the config's ``torch_dtype``, else the file's).
        progress: show a progress bar over the bytes read.

    Returns:
        An :class:`~ddo_blocks.api.OffloadHandle`; ``handle.module`` is the loaded model.

    Raises:
        CheckpointError: a missing, truncated or corrupt file or shard, a tensor whose shape does not
            match the model, an unexpected or missing key. Raised before anything is allocated.
    """
    from .api import offload

    if "torch_dtype" in options:
        raise ConfigError(
            f"from_pretrained() takes dtype=, not torch_dtype= (got torch_dtype={options['torch_dtype']!r}); "
            "pass dtype=torch.bfloat16, or leave it out to take the config's torch_dtype"
        )
    directory = Path(path) / subfolder if subfolder else Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; pass the model directory (and subfolder=)")
    if quantization_method(directory) is not None:
        return _from_quantized(model_class, directory, route=route, preset=preset, vram_budget=vram_budget,
                               device=device, dtype=dtype, component=component, **options)
    checkpoint = Checkpoint(directory)
    if dtype is None and (directory / "config.json").is_file():
        dtype = config_dtype(directory)
    model = build_on_meta(model_class, directory, dtype)
    if dtype is None:  # no dtype anywhere: take the file's, per tensor
        for name, p in model.named_parameters():
            src = checkpoint.tensors.get(name)
            if src is not None and p.is_floating_point() and same_kind(src.dtype, p.dtype):
                p.data = p.data.to(src.dtype)
    unmeta(model)
    loader = Loader(model, checkpoint, progress=progress)
    # persistent buffers from the checkpoint
    for b in model.buffers():
        if loader.pending(b):
            loader.read_many([(loader.take(b), b)])
    try:
        handle = offload(model, route=route, preset=preset, vram_budget=vram_budget, device=device,
                         component=component, _loader=loader, **options)
        checkpoint.check_unchanged()
    except BaseException:
        loader.close()
        raise
    loader.close()
    handle.setup_bytes_read = loader.bytes_read
    return handle
