"""Guards: what keeps an offloaded module from being changed under its engine without an error.

A streaming engine owns where every parameter of its component lives (slab views, slots, resident
copies). Three kinds of change would otherwise go unnoticed and give wrong tensors, or break
``remove()``:

- **conversions** (``module.to(dtype)``, ``.half()``, ``.cpu()``, ``pipe.to("cpu")``): every module of
  the component gets an ``_apply`` of its own that lets a conversion that changes nothing through
  (``pipe.to("cuda")`` on a component already running on that GPU) and refuses any other with
  ``OffloadStateError``;
- **stacked offloads**: offloading a submodule of an offloaded module, or the module that holds an
  offloaded one (marks on every submodule, checked by ``offload()``), and diffusers'
  ``enable_group_offload`` on top (refused on the instance);
- **offloading hooks installed on top** (``apply_group_offloading``, accelerate's ``cpu_offload``,
  ``enable_model_cpu_offload``), which wrap ``forward`` and replace or move parameters: the engine
  checks at the start of every call that no such hook sits on the module, and refuses the call.

All of it is removed again by ``remove()``. ``foreign_offload`` finds offloading that something
else attached *before* ours (diffusers group offloading, accelerate hooks), which ``offload()`` and
the blocks refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _native
from ..errors import OffloadStateError

OWNER_ATTR = "_ddo_owner"
"""On every submodule of an offloaded component: the handle of that offload."""

_GROUP_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")


def owner_of(module: nn.Module) -> Any:
    """The offload this module belongs to as a submodule, if any."""
    return module.__dict__.get(OWNER_ATTR)


class ConversionGuard:
    """Refuses conversions of an offloaded component's modules (``.to``, ``.half``, ``.cpu``, ...)
    that would change a dtype or a device, and diffusers' ``enable_group_offload`` on top."""

    def __init__(self, module: nn.Module, device: torch.device, describe: Callable[[], str]):
        self.module = module
        self.device = device
        self.describe = describe
        self._installed: list[tuple[nn.Module, str, Any]] = []
        self._dtypes = sorted({t.dtype for t in (*module.parameters(), *module.buffers())}, key=str)

    def install(self, handle: Any) -> None:
        for sub in self.module.modules():
            if sub is not self.module:
                sub.__dict__[OWNER_ATTR] = handle
            self._installed.append((sub, "_apply", self._make_apply(sub)))
            if callable(getattr(sub, "enable_group_offload", None)):
                self._installed.append((sub, "enable_group_offload", self._refuse_group_offload))
        for sub, name, fn in self._installed:
            sub.__dict__[name] = fn

    def remove(self) -> None:
        for sub, name, fn in self._installed:
            if sub.__dict__.get(name) is fn:
                del sub.__dict__[name]
            if sub.__dict__.get(OWNER_ATTR) is not None:
                del sub.__dict__[OWNER_ATTR]
        self._installed.clear()

    def changes_something(self, fn: Callable[[torch.Tensor], Any]) -> bool:
        """Whether the conversion ``fn`` would change a dtype or device of the component: it is
        tried on an empty tensor of each dtype the component holds, on the device it runs on."""
        for dtype in self._dtypes:
            probe = torch.empty(0, dtype=dtype, device=self.device)
            out = fn(probe)
            if not isinstance(out, torch.Tensor) or out.dtype != dtype or out.device != probe.device:
                return True
        return False

    def _make_apply(self, sub: nn.Module) -> Callable[..., nn.Module]:
        def _apply(fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> nn.Module:
            if self.changes_something(fn):
                where = "" if sub is self.module else f" (a submodule, {type(sub).__name__})"
                raise OffloadStateError(
                    f"{type(self.module).__name__}{where} is offloaded ({self.describe()}) and its weights live "
                    "where the offload put them: converting it (.to(dtype), .half(), .cpu(), another device, "
                    "pipe.to(...)) now would leave the offload with tensors it no longer knows. Call remove() "
                    "on the handle, convert the module, and offload it again"
                )
            return sub  # changes nothing: the weights already are what was asked for

        return _apply

    def _refuse_group_offload(self, *args: Any, **kwargs: Any) -> None:
        raise OffloadStateError(
            f"{type(self.module).__name__} is already offloaded by ddo_blocks ({self.describe()}); diffusers "
            "group offloading on top would move the same weights a second time. Call remove() on the handle "
            "first, or use ddo_blocks.offload(..., route='diffusers') for diffusers' own offloading"
        )


def hooks_on(module: nn.Module, modules: list[nn.Module] | None = None) -> tuple[str | None, str | None]:
    """One pass over the modules (``modules``: a list of them made earlier, faster to walk than the
    tree): ``(offloading on top, stateful hooks)``, each described or ``None``. Offloading on top is
    an offloading hook installed on ``module`` or a submodule after ours (diffusers group offloading,
    accelerate's offload hooks); other wrappers of ``forward`` (a user's profiler, the blocks'
    execution-device hook) are fine: the engine's entry point still runs inside them. Stateful hooks
    are diffusers' hooks of any kind (caches that count steps, layer skipping): a CUDA graph would
    replay their first captured step for ever."""

    def where(sub: nn.Module) -> str:  # names are looked up only for what is reported
        name = next((n for n, s in module.named_modules() if s is sub), "?")
        return f" on {name}" if name else ""

    stateful = None
    for sub in modules if modules is not None else module.modules():
        d = sub.__dict__
        registry = d.get("_diffusers_hook")
        if registry is not None:
            hooks = [n for n in _GROUP_HOOKS if registry.get_hook(n) is not None]
            if hooks:
                return (f"diffusers group offloading{where(sub)} (hooks {', '.join(hooks)}; apply_group_offloading)",
                        None)
            names = list(getattr(registry, "hooks", {}) or {})
            if names and stateful is None:
                stateful = f"diffusers hooks{where(sub)} ({', '.join(map(str, names))})"
        hook = d.get("_hf_hook")
        if hook is not None and not getattr(hook, "_ddo_owned", False):
            return (f"an accelerate hook{where(sub)} ({type(hook).__name__}: cpu_offload, enable_model_cpu_offload or "
                    "enable_sequential_cpu_offload)"), None
    return None, stateful


class HookScan:
    """What :func:`hooks_on` and a CUDA graph's key read from a component's modules, in one pass over
    their ``__dict__``s (listed once) in Rust (``_native.scan_module_dicts``): the forward hooks'
    count and newest id (the hook dicts are looked up every call: code may replace them,
    ``m._forward_hooks = OrderedDict()``), and any diffusers registry or accelerate hook, which are
    then looked at here. What it finds is the same as the walks'; when a hook of interest is there,
    the walk runs to name it.

    A scan's result is kept with a ``_native.TreeWatch`` of every dict it read, taken before it: a
    call whose dicts all kept their CPython version tags gets the kept result without a scan (any
    write to one of them, by any way, moves its tag). Where the tags do not work, where a hook
    dict is not a dict, or where a diffusers registry sits in the tree (its hooks live in objects
    no watch covers), every call scans."""

    def __init__(self, module: nn.Module, modules: list[nn.Module]):
        self.module = module
        self.modules = modules
        self._dicts = [m.__dict__ for m in modules]
        self._kept: tuple[Any, tuple] | None = None
        """``(watch, result)`` of the last scan that a watch can stand for."""

    def scan(self) -> tuple[tuple[int, int, int], tuple[str | None, str | None]]:
        """``((hook count, newest hook id, tree), hooks_on(...))``: the forward hooks on every module
        (torch numbers hooks from one counter, so a hook removed and another added changes the id),
        a hash of every module's parameters, buffers and submodules by identity (``tree``: a tensor
        or a layer put in another's place, removed or added changes it), and :func:`hooks_on`'s
        ``(offloading on top, stateful hooks)``."""
        kept = self._kept
        if kept is not None and kept[0].unchanged():
            return kept[1]
        watch = _native.TreeWatch.snapshot(self._dicts)  # before the scan: a write after it is seen next call
        count, newest, found, tree = _native.scan_module_dicts(self._dicts)
        # a registry with no hooks left finds nothing; one without a ``hooks`` dict is walked
        registries = any(r is not None and getattr(r, "hooks", True) for _, r, _ in found)
        foreign = any(h is not None and not getattr(h, "_ddo_owned", False) for _, _, h in found)
        on = hooks_on(self.module, self.modules) if registries or foreign else (None, None)
        result = (count, newest, tree), on
        # our own execution-device hook is kept by identity in a watched ``__dict__``; a registry is not
        stable = watch is not None and not foreign and all(r is None for _, r, _ in found)
        self._kept = (watch, result) if stable else None
        return result

    def hooks_on(self) -> tuple[str | None, str | None]:
        """:func:`hooks_on` of the component: ``(offloading on top, stateful hooks)``."""
        return self.scan()[1]


def foreign_offload(module: nn.Module) -> str | None:
    """Describes offloading already attached to ``module`` by something else, or ``None``.

    Looks for diffusers group offloading and accelerate hooks that move weights
    (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``, ``device_map``).
    """
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    if _is_group_offload_enabled(module):
        return (
            "already has diffusers group offloading (enable_group_offload / apply_group_offloading); "
            "remove it first, or keep it and give this component route='off'"
        )
    for sub_name, sub in module.named_modules():
        hook = getattr(sub, "_hf_hook", None)
        if hook is None or getattr(hook, "_ddo_owned", False):
            continue
        where = f" on {sub_name}" if sub_name else ""
        return (
            f"already has an accelerate hook{where} ({type(hook).__name__}: enable_model_cpu_offload, "
            "enable_sequential_cpu_offload or a device_map); remove it (accelerate.hooks.remove_hook_from_module"
            "(module, recurse=True)) first, or keep it and give this component route='off'"
        )
    return None
