"""One host copy of the weights for several offloads: a replica of an offloaded component (for a
second GPU, or a second generation side by side) whose parameters point at the first offload's
host memory.

    h0 = ddo_blocks.offload(transformer, device="cuda:0", vram_budget="8GiB")
    twin = ddo_blocks.replica(transformer)            # no weight is copied
    h1 = ddo_blocks.offload(twin, device="cuda:1", vram_budget="8GiB")

:func:`share_weights` points a module of the same structure (built on the meta device, say) at the
host copies of an offloaded module's weights: its streamed units' slab views as they are, and a host
copy of what that offload keeps on the device (made once: the first offload holds no host copy of
its resident units). Offloading the replica then *borrows* every unit it finds in the first
offload's slabs (``streaming.slabs``): neither copied nor page-locked again, so two offloads hold
about one host copy of the weights, plus the units the first keeps resident. Each offload has its
own slots, streams and plan; removing one leaves the other working; a slab is unpinned with its last
user and freed with the last tensor pointing into it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import ConfigError


def _host_copy(t: torch.Tensor, streamed: bool) -> torch.Tensor:
    """A streamed unit's host view as it is (shared: the replica's offload borrows its slab), else a
    host copy of its own (what the first offload keeps on its device, the CPU included: sharing that
    memory would tie the two modules' weights together after either offload is removed)."""
    return t.detach() if streamed else t.detach().to("cpu", copy=True)


def _set(module: nn.Module, name: str, value: Any, kind: str) -> None:
    owner, _, leaf = name.rpartition(".")
    getattr(module.get_submodule(owner) if owner else module, kind)[leaf] = value


def share_weights(src: nn.Module, dst: nn.Module) -> nn.Module:
    """Points ``dst``'s parameters and buffers at ``src``'s host copies and returns ``dst``.

    ``src`` is offloaded by ddo_blocks with host slabs (the linear or sdnq route; not a codec, the
    NVMe route or ``warm_process``); ``dst`` has the same parameters and buffers (names, shapes,
    dtypes), e.g. the same class built on the meta device (:func:`replica` does that for diffusers
    models). Ties within ``src`` (one parameter under two names) stay ties in ``dst``. ``dst`` gets
    its own ``Parameter`` objects; offloading it borrows the units it finds in ``src``'s slabs.
    Not while ``src`` is being called.

    Raises:
        ConfigError: ``src`` is not offloaded with host slabs, or the two modules differ.
    """
    from .api import get_handle
    from .streaming.stores import HostSlabs

    handle = get_handle(src)
    store = getattr(getattr(handle, "engine", None), "store", None)
    if handle is None or type(store) is not HostSlabs or store.slabs is None or store.slabs.keep_warm:
        what = "not offloaded by ddo_blocks" if handle is None else f"offloaded as {handle!r}"
        raise ConfigError(
            f"share_weights: {type(src).__name__} is {what}; its weights are shared from the host slabs of an "
            "offload on the linear or sdnq route with preset one_shot_fast, low_ram_safe, wsl_compat or sdnq (not a "
            "codec, route='nvme' or warm_process): offload it that way first"
        )
    if dst is src or get_handle(dst) is not None:
        raise ConfigError("share_weights: the destination must be another module, not offloaded yet")
    sp, dp = list(src.named_parameters(remove_duplicate=False)), list(dst.named_parameters(remove_duplicate=False))
    sb, db = list(src.named_buffers(remove_duplicate=False)), list(dst.named_buffers(remove_duplicate=False))
    for kind, a, b in (("parameters", sp, dp), ("buffers", sb, db)):
        if [n for n, _ in a] != [n for n, _ in b]:
            extra = sorted({n for n, _ in a} ^ {n for n, _ in b})
            raise ConfigError(
                f"share_weights: {type(src).__name__} and {type(dst).__name__} have different {kind}"
                f"{' (' + ', '.join(extra[:4]) + ')' if extra else ' (in another order)'}: build the destination "
                "as the same class with the same config"
            )
        for (name, x), (_, y) in zip(a, b):
            if x.shape != y.shape:
                raise ConfigError(f"share_weights: {name} is {tuple(x.shape)} in the source and "
                                  f"{tuple(y.shape)} in the destination")
    from .streaming.edits import get_data

    streamed = {id(p) for unit in handle.engine.streamed for _, p in unit.params}
    made: dict[int, nn.Parameter] = {}
    for name, p in sp:
        new = made.get(id(p))
        if new is None:
            new = made[id(p)] = nn.Parameter(_host_copy(get_data(p), id(p) in streamed), requires_grad=False)
        _set(dst, name, new, "_parameters")
    copies: dict[int, torch.Tensor] = {}
    for name, b in sb:
        if id(b) not in copies:
            copies[id(b)] = b.detach().to("cpu", copy=True)
        _set(dst, name, copies[id(b)], "_buffers")
    return dst


def replica(module: nn.Module) -> nn.Module:
    """A second instance of an offloaded diffusers model that shares its host weights: the same class
    built from the same config on the meta device, then :func:`share_weights`. For other modules,
    build the twin yourself (on the meta device) and call :func:`share_weights`.

    Raises:
        ConfigError: not a diffusers model (no ``from_config``/``config``), or as
        :func:`share_weights`.
    """
    cls, config = type(module), getattr(module, "config", None)
    if config is None or not hasattr(cls, "from_config"):
        raise ConfigError(
            f"replica: {cls.__name__} is not a diffusers model with a config; build the second instance yourself "
            "(e.g. on torch.device('meta')) and call ddo_blocks.share_weights(module, twin)"
        )
    with torch.device("meta"):
        twin = cls.from_config(config)
    share_weights(module, twin)
    # tensors kept as plain attributes (not parameters or buffers) were built on meta: not usable
    left = [f"{name}.{k}" if name else k for name, m in twin.named_modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor) and v.device.type == "meta"]
    if left:
        raise ConfigError(
            f"replica: {cls.__name__} keeps tensors outside its parameters and buffers ({', '.join(left[:4])}), which "
            "a replica built from its config cannot share; build the second instance yourself and call "
            "ddo_blocks.share_weights(module, twin)"
        )
    return twin.eval().requires_grad_(False)
