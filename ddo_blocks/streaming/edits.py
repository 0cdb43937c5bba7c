"""Edits to an offloaded component's weights: seen or refused, never missed.

Users change weights while a component is offloaded: peft fuses a LoRA (``weight.data += delta`` or
``weight.data = fused``), ``load_state_dict`` copies into every parameter, a script edits one in
place. The engine keeps a streamed unit's bytes in a host copy (and prefetches the next call's first
units into slots at the end of a call), so an edit that only one copy sees would be missed. The
contract, enforced here for every parameter whose values the engine keeps somewhere else than where
the parameter points (the streamed units', and the arena's resident units' on the vmm route):

- **Seen.** Between calls a streamed parameter points at its host copy, so an edit through it
  lands there. Each such parameter gets a subclass of its own class whose ``data`` property returns
  a view sharing the parameter's version counter (an edit through ``.data``, or through an alias of
  it kept for later, moves the counter) and writes an assignment (``p.data = t``, ``p.data += d``)
  into the memory the parameter points at (and the host copy, if that is elsewhere) instead of
  re-pointing it; in-place operations on the parameter itself (``p.copy_``, ``load_state_dict``)
  move the counter too. The engine compares the counters at every call's start and settles what
  changed: prefetched slot copies of changed units are fetched again from the host, a parameter
  pointed at other memory (``p.set_(t)``) gives its values to its host copy, arena-resident units
  edited on the device are copied back to their host copy (they are evicted and restored from it).
- **Refused.** Where a unit's host copy is not its values (a coded unit, a unit read from disk),
  its parameters point at placeholders between calls; there a parked subclass refuses any read of
  their values and any operation that gets one, lists of tensors included (``OffloadStateError``
  naming the parameter and what works), instead of letting a placeholder reach user code; shape,
  dtype and device answer, through ``.data`` and ``state_dict()`` too. An assignment of another
  shape or dtype, or of a tensor subclass, is refused: the unit's layout was fixed at offload time.
- **Structure.** A layer added inside a streamed unit after the offload (a LoRA's ``lora_A`` /
  ``lora_B``, a DoRA magnitude) is an adapter: watched, and on a GPU given a device copy its unit
  points it at while it runs (peft edits it on the host, beside the parked base weight; switching
  adapters or their strengths moves no base bytes). A streamed parameter replaced by another, or
  held by a module that runs outside its unit, is refused at the next call: the unit's plan no
  longer describes the model (the engine's ``_follow_structure``).

Everything is undone by ``remove()``: the parameters get their own class back.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import OffloadStateError

_DATA = torch._C.TensorBase.data
"""The ``data`` descriptor of every tensor: what the engine uses to point a parameter somewhere."""

_ATTR = "_ddo_edit"
"""On a watched parameter: ``(watch, key, name, its position in the group, has a version counter)``."""

_VERSION = operator.attrgetter("_version")


def get_data(p: torch.Tensor) -> torch.Tensor:
    """``p.data`` without the watch (the engine's own reads, placeholders included)."""
    with torch._C.DisableTorchFunctionSubclass():
        return _DATA.__get__(p)


set_data: Callable[[torch.Tensor, torch.Tensor], None] = _DATA.__set__
"""``p.data = value`` without the watch writing it through (the engine pointing a parameter at a slot
or its host copy, twice per parameter per call): the descriptor itself, no Python frame."""


# -------------------------------------------------------------------------------------------------
# the parameter classes
# -------------------------------------------------------------------------------------------------
def _watched_get(self: torch.Tensor) -> torch.Tensor:
    info = self.__dict__.get(_ATTR)
    if info is None:
        return _DATA.__get__(self)
    if not info[4] or type(self).__torch_function__ is not torch._C._disabled_torch_function_impl:
        # an inference tensor has no version counter, and a subclass with its own torch function
        # (GGUF's) keeps its class through .data: any access may be an edit
        info[0].touched.add(info[1])
        return _DATA.__get__(self)
    # a view that shares the parameter's version counter (``.data`` would get one of its own): an edit
    # through it, now or later through a kept reference, moves the counter the next call compares
    with torch._C.DisableTorchFunctionSubclass():
        return self.detach()


def _watched_set(self: torch.Tensor, value: torch.Tensor) -> None:
    info = self.__dict__.get(_ATTR)
    if info is None:
        _DATA.__set__(self, value)
    else:
        info[0].write(self, info, value)


@contextlib.contextmanager
def _unwatched(p: torch.Tensor) -> Iterator[None]:
    """``p`` as its own class without the watch, for the length of the block."""
    info = p.__dict__.pop(_ATTR, None)
    cls = type(p)
    p.__class__ = cls._ddo_base
    try:
        yield
    finally:
        p.__class__ = cls
        if info is not None:
            p.__dict__[_ATTR] = info


def _watched_reduce_ex(self: torch.Tensor, protocol: int) -> Any:
    """Pickled as its own class (``torch.save``), without the watch."""
    with _unwatched(self):
        return self.__reduce_ex__(protocol)


def _watched_deepcopy(self: torch.Tensor, memo: dict) -> torch.Tensor:
    """A copy of its own class with the values it has now (``copy.deepcopy``), without the watch."""
    with _unwatched(self):
        return self.__deepcopy__(memo)


def _parked_get(self: torch.Tensor) -> torch.Tensor:
    info = self.__dict__.get(_ATTR)
    with torch._C.DisableTorchFunctionSubclass():
        data = _DATA.__get__(self)
    if info is None:
        return data
    return _parked_view(data, info)  # shape and dtype answer (diffusers reads them); values refuse


def _parked_set(self: torch.Tensor, value: torch.Tensor) -> None:
    info = self.__dict__.get(_ATTR)
    if info is None:
        _DATA.__set__(self, value)
    else:
        raise info[0].refusal(info[2], "its .data was assigned")


def _parked_refuse(self: torch.Tensor, *args: Any) -> Any:
    info = self.__dict__.get(_ATTR)
    raise info[0].refusal(info[2], "it was copied or pickled")


_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "data_ptr", "is_contiguous", "storage_offset", "__hash__", "requires_grad_", "get_device", "__len__",
    "is_inference",
})
"""What a parked placeholder answers: its shape, dtype, device and flags, never its values."""

_PROPERTIES = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_cuda", "is_cpu", "is_meta", "ndim", "grad", "grad_fn",
    "_version", "layout", "is_leaf", "names", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes",
    "output_nr", "_base", "_cdata", "is_mps", "is_xpu", "_backward_hooks", "_post_accumulate_grad_hooks",
})
"""The properties a parked placeholder answers (``.T``, ``.mT``, ``.real`` and the like would be values)."""


def _parked_view(data: torch.Tensor, info: tuple) -> torch.Tensor:
    view = torch.Tensor._make_subclass(ParkedTensor, data)
    view.__dict__[_ATTR] = info
    return view


def _parked_in(args: tuple, kwargs: dict | None) -> torch.Tensor | None:
    """The first tensor carrying a watch among the arguments, nested ones included (``torch.cat([...])``)."""
    for a in torch.utils._pytree.tree_leaves((args, kwargs or {})):
        if isinstance(a, torch.Tensor) and _ATTR in a.__dict__:
            return a
    return None


def _parked_torch_function(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    name = getattr(func, "__name__", "")
    prop = getattr(getattr(func, "__self__", None), "__name__", "") if name in ("__get__", "__set__") else ""
    if name == "__set__" or (name == "__get__" and prop in _PROPERTIES and prop != "data") or name in _METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    parked = _parked_in(args, kwargs)
    if parked is None:  # no watch to name (its offload was removed): plain behaviour
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    info = parked.__dict__[_ATTR]
    watch, pname = info[0], info[2]
    if name == "detach" or prop == "data":  # state_dict(), .data: a view that refuses reads as the parameter does
        with torch._C.DisableTorchFunctionSubclass():
            return _parked_view(func(*args, **(kwargs or {})), info)
    if name == "__repr__":
        return (f"Parameter({pname}: {tuple(parked.shape)} {parked.dtype}, offloaded by ddo_blocks; "
                f"{watch.where()} between calls)")
    raise watch.refusal(pname, f"{name or func} was called on it")


class ParkedTensor(torch.Tensor):
    """A placeholder seen from outside (``p.data``, ``module.state_dict()`` of a parked parameter): its
    shape, dtype and device answer, any read of its values is refused like the parameter's."""

    __torch_function__ = classmethod(_parked_torch_function)


_CLASSES: dict[tuple[type, bool], type] = {}


def _class_for(base: type, parked: bool) -> type:
    """The watched (``parked``: the placeholder-refusing) subclass of a parameter class, made once."""
    key = (base, parked)
    cls = _CLASSES.get(key)
    if cls is None:
        if parked:
            ns = {"data": property(_parked_get, _parked_set), "__torch_function__": classmethod(_parked_torch_function),
                  "__reduce_ex__": _parked_refuse, "__deepcopy__": _parked_refuse}
            cls = type(base)(f"Parked{base.__name__}", (_class_for(base, False),), ns)
        else:
            ns = {"data": property(_watched_get, _watched_set), "__reduce_ex__": _watched_reduce_ex,
                  "__deepcopy__": _watched_deepcopy}
            if base.__torch_function__ is torch._C._disabled_torch_function_impl:
                # found on the class itself: torch looks it up for every operation on a subclass
                ns["__torch_function__"] = torch._C._disabled_torch_function_impl
            cls = type(base)(f"Watched{base.__name__}", (base,), ns)
        # findable by its module and name (torch.compile looks a parameter's class up that way)
        name = cls.__name__ if cls.__name__ not in globals() else f"{cls.__name__}_{len(_CLASSES)}"
        cls.__name__ = cls.__qualname__ = name
        cls.__module__ = __name__
        globals()[name] = cls
        cls._ddo_base = base
        _CLASSES[key] = cls
    return cls


# -------------------------------------------------------------------------------------------------
# the watch
# -------------------------------------------------------------------------------------------------
Key = tuple[str, int]
"""A group of parameters the engine settles together: ``("streamed", u)``, ``("resident", i)``."""


class EditWatch:
    """The watched parameters of one engine.

    Args:
        component: the component's class name, for messages.
        groups: ``(key, [(name, parameter)], placeholder)`` per group; ``placeholder``: between calls
            its parameters point at placeholders (refuse every read) rather than at their values.
        host_of: the host copy of a group's ``i``-th parameter when it is not where the parameter
            points now (a unit in its slot or in the arena), else ``None``.
        where: what holds the placeholder groups' values, for messages.
    """

    def __init__(self, component: str, groups: list[tuple[Key, list[tuple[str, nn.Parameter]], bool]],
                 host_of: Callable[[Key, int], torch.Tensor | None], where: Callable[[], str]):
        self.component = component
        self.host_of = host_of
        self._where = where
        self.touched: set[Key] = set()
        self.params: list[nn.Parameter] = []
        """Watched parameters with a version counter (compared at each call's start)."""
        self.keys: list[Key] = []
        self.versions: list[int] = []
        self.untracked: list[nn.Parameter] = []
        """Watched inference tensors (made under ``torch.inference_mode()``: no version counter)."""
        self.placeholder: set[Key] = {key for key, _, ph in groups if ph}
        self._classes: dict[Key, tuple[list[nn.Parameter], list[type], list[type]]] = {}
        self._orig: dict[int, type] = {}
        self.settled = 0
        """Groups settled since attach (edits seen)."""
        try:
            for key, params, placeholder in groups:
                plist, watched, parked = [], [], []
                for i, (name, p) in enumerate(params):
                    if _ATTR in p.__dict__:
                        continue  # a parameter shared by two units: watched once
                    self._watch(key, name, i, p, placeholder)
                    plist.append(p)
                    watched.append(_class_for(self._orig[id(p)], False))
                    parked.append(_class_for(self._orig[id(p)], True))
                if placeholder:
                    self._classes[key] = (plist, watched, parked)
        except BaseException:
            self.remove()
            raise

    def _watch(self, key: Key, name: str, i: int, p: nn.Parameter, placeholder: bool) -> None:
        try:
            version = p._version
            tracked = True
        except RuntimeError:  # made under torch.inference_mode(): no version counter, even pointed elsewhere
            tracked = False
        self._orig[id(p)] = type(p)
        if tracked:
            self.params.append(p)
            self.keys.append(key)
            self.versions.append(version)
        else:
            self.untracked.append(p)
        p.__dict__[_ATTR] = (self, key, name, i, tracked)
        p.__class__ = _class_for(self._orig[id(p)], placeholder)

    # -- the engine's side -------------------------------------------------------------------------
    def bound(self, key: Key) -> None:
        """A placeholder group's parameters point at their values (a slot): they behave as usual."""
        got = self._classes.get(key)
        if got is not None:
            for p, cls in zip(got[0], got[1]):
                p.__class__ = cls

    def parked(self, key: Key) -> None:
        """A placeholder group's parameters point at placeholders again: every read is refused."""
        got = self._classes.get(key)
        if got is not None:
            for p, cls in zip(got[0], got[2]):
                p.__class__ = cls

    def changed(self) -> set[Key]:
        """The groups edited since the last call (a version moved, ``.data`` assigned, or an inference
        tensor's ``.data`` read); forgets them."""
        now = list(map(_VERSION, self.params))
        dirty = self.touched
        if now != self.versions:
            dirty = dirty | {k for k, a, b in zip(self.keys, now, self.versions) if a != b}
            self.versions = now
        if dirty:
            self.touched = set()
            self.settled += len(dirty)
        return dirty

    def add(self, key: Key, name: str, p: nn.Parameter) -> None:
        """Watches one more parameter (an adapter added inside a unit after the attach)."""
        if _ATTR not in p.__dict__:
            self._watch(key, name, 0, p, False)

    def watches(self, p: torch.Tensor) -> bool:
        """Whether ``p`` still carries this watch (``torch.utils.swap_tensors`` moves a tensor's class
        and ``__dict__`` to the other tensor)."""
        info = p.__dict__.get(_ATTR)
        return info is not None and info[0] is self

    def forget(self, p: nn.Parameter) -> None:
        """Stops watching ``p`` (it left the module, or a swap took the watch away)."""
        if self.watches(p):
            p.__dict__.pop(_ATTR, None)
            p.__class__ = self._orig[id(p)]
        self._orig.pop(id(p), None)
        for i, q in enumerate(self.params):
            if q is p:
                for seq in (self.params, self.keys, self.versions):
                    del seq[i]
                return
        self.untracked = [q for q in self.untracked if q is not p]

    def pending(self, kind: str | None = None) -> bool:
        """Whether :meth:`changed` would find edits (of groups of ``kind``, or any); nothing is forgotten."""
        if any(kind is None or k[0] == kind for k in self.touched):
            return True
        now = list(map(_VERSION, self.params))
        return any(a != b and (kind is None or k[0] == kind) for k, a, b in zip(self.keys, now, self.versions))

    def remove(self) -> None:
        """Every parameter gets its own class back."""
        for p in (*self.params, *self.untracked):
            if self.watches(p):
                p.__dict__.pop(_ATTR, None)
                p.__class__ = self._orig[id(p)]
        self.params, self.untracked, self.keys, self.versions = [], [], [], []
        self._orig, self._classes = {}, {}

    # -- the parameters' side ----------------------------------------------------------------------
    def write(self, p: nn.Parameter, info: tuple, value: Any) -> None:
        """``p.data = value``: the values go into the memory ``p`` points at (and its host copy)."""
        _, key, name, i, _ = info
        if key[0] == "adapter":  # its own memory, no layout to keep: it points there; its device copy follows
            _DATA.__set__(p, value)
            self.touched.add(key)
            return
        now = _DATA.__get__(p)
        if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor:
            raise OffloadStateError(
                f"{name} of {self.component} is offloaded by ddo_blocks, and its .data was assigned a "
                f"{type(value).__name__}: an offloaded parameter takes plain tensors of its own shape and dtype "
                "(the unit's layout was fixed at offload time). Call remove() on the handle, change the module, "
                "and offload it again"
            )
        if value.shape != now.shape or value.dtype != now.dtype:
            raise OffloadStateError(
                f"{name} of {self.component} is offloaded by ddo_blocks as {tuple(now.shape)} {now.dtype}, and "
                f"its .data was assigned {tuple(value.shape)} {value.dtype}: its slot and host copy hold that "
                "layout only. Call remove() on the handle, change the module, and offload it again"
            )
        with torch.no_grad():
            same = (value.data_ptr() == now.data_ptr() and value.stride() == now.stride())
            if not same:  # another tensor, or the same memory seen another way (w.data = w.data.t())
                if value.untyped_storage().data_ptr() == now.untyped_storage().data_ptr():
                    value = value.clone()
                now.copy_(value)
            host = self.host_of(key, i)
            if host is not None and getattr(host, "_ddo_placeholder", False):
                raise self.refusal(name, "its .data was assigned")
            if host is not None and host.data_ptr() != now.data_ptr():
                host.copy_(value)
        self.touched.add(key)

    def where(self) -> str:
        return self._where()

    def refusal(self, name: str, what: str) -> OffloadStateError:
        return OffloadStateError(
            f"{name} of {self.component} was used outside its unit's call ({what}), but it is offloaded by "
            f"ddo_blocks and its values are {self.where()} between calls: a placeholder stands in its place. "
            "Reading or editing such a weight needs its values: apply the change (a LoRA to fuse, DoRA, "
            "a state dict) before offload(), keep LoRA adapters unfused (they run beside the streamed "
            "weights), or call remove() on the handle, change the module, and offload it again"
        )

