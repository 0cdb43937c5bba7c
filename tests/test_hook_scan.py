"""``guards.HookScan``: the one-pass scan (Rust, ``_native.scan_module_dicts``) that the per-call hook
checks and a CUDA graph's key read, against the Python walks it replaced."""

from __future__ import annotations

import collections
import sys
import types

import pytest
import torch
from torch import nn

from ddo_blocks import _native
from ddo_blocks.streaming import guards


def _tree() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)), nn.GELU())


def _walk(modules: list[nn.Module]) -> tuple[int, int]:
    """The Python walk of the hook dicts that the graph key used before the scan."""
    count, newest = 0, -1
    for m in modules:
        for d in (m._forward_hooks, m._forward_pre_hooks):
            if d:
                count += len(d)
                newest = max(newest, max(d))
    return count, newest


def test_the_scan_counts_hooks_as_the_walk_does():
    model = _tree()
    modules = list(model.modules())
    scan = guards.HookScan(model, modules)
    assert scan.scan()[0][:2] == _walk(modules) == (0, -1)
    handles = [modules[1].register_forward_hook(lambda m, a, o: None),
               modules[4].register_forward_pre_hook(lambda m, a: None),
               modules[4].register_forward_hook(lambda m, a, o: None, always_call=True)]
    assert scan.scan()[0][:2] == _walk(modules) and scan.scan()[0][0] == 3
    handles[0].remove()
    assert scan.scan()[0][:2] == _walk(modules) and scan.scan()[0][0] == 2
    # a hook dict replaced by code that clears hooks, then a hook added to the new one
    modules[3]._forward_hooks = collections.OrderedDict()
    modules[3].register_forward_hook(lambda m, a, o: None)
    assert scan.scan()[0][:2] == _walk(modules) and scan.scan()[0][0] == 3
    # a mapping that is not a dict is counted as Python counts it
    modules[2].__dict__["_forward_pre_hooks"] = types.MappingProxyType({10**6: lambda m, a: None})
    assert scan.scan()[0][:2] == (4, 10**6)


def test_the_scan_finds_registries_and_accelerate_hooks_and_names_only_foreign_ones():
    model = _tree()
    modules = list(model.modules())
    scan = guards.HookScan(model, modules)
    assert scan.scan()[1] == (None, None) and _native.scan_module_dicts([m.__dict__ for m in modules])[2] == []

    class Owned:
        _ddo_owned = True

    modules[1]._hf_hook = Owned()  # ours (the execution-device hook): nothing to refuse
    (_, _, found, _) = _native.scan_module_dicts([m.__dict__ for m in modules])
    assert [(i, r, type(h)) for i, r, h in found] == [(1, None, Owned)]
    assert scan.hooks_on() == (None, None) == guards.hooks_on(model, modules)

    class EmptyRegistry:
        hooks: dict = {}

        def get_hook(self, name):
            return None

    modules[3]._diffusers_hook = EmptyRegistry()  # a registry whose hooks were all removed
    assert scan.hooks_on() == (None, None) == guards.hooks_on(model, modules)

    class Cache:
        hooks = {"first_block_cache": object()}

        def get_hook(self, name):
            return None

    modules[3]._diffusers_hook = Cache()
    assert scan.hooks_on() == guards.hooks_on(model, modules)
    assert scan.hooks_on()[1] is not None and "first_block_cache" in scan.hooks_on()[1]

    class Foreign:  # an accelerate hook: offloading on top
        pass

    modules[4]._hf_hook = Foreign()
    on_top, _ = scan.hooks_on()
    assert on_top is not None and "accelerate hook" in on_top and on_top == guards.hooks_on(model, modules)[0]


def test_the_scan_sees_an_attribute_set_to_none_as_absent():
    model = _tree()
    modules = list(model.modules())
    modules[2]._hf_hook = None
    assert _native.scan_module_dicts([m.__dict__ for m in modules])[2] == []
    assert guards.HookScan(model, modules).hooks_on() == (None, None)


def test_hook_keys_that_are_not_torch_ids_are_keyed_not_refused():
    model = _tree()
    modules = list(model.modules())
    scan = guards.HookScan(model, modules)
    modules[1]._forward_hooks["probe"] = lambda m, a, o: None  # someone's own key
    modules[2]._forward_hooks[2**70] = lambda m, a, o: None
    (count, newest, _), on = scan.scan()
    assert count == 2 and on == (None, None)
    del modules[1]._forward_hooks["probe"]
    assert scan.scan()[0] != (count, newest)  # a change is still seen


def test_the_tree_hash_sees_tensors_and_layers_put_in_place_by_any_way():
    """The third figure of the scan: what every module's ``_parameters``, ``_buffers`` and ``_modules``
    hold, by identity. A CUDA graph's key holds it, so that a replay never runs with a tensor or a
    layer that is no longer the module's."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model.register_buffer("scale", torch.ones(1))
    modules = list(model.modules())
    scan = guards.HookScan(model, modules)

    def tree():
        return scan.scan()[0][2]

    seen = [tree()]
    model[0].weight.data = torch.zeros(4, 4)  # the same tensor object: its memory is the key's business
    model[0].register_forward_hook(lambda m, a, o: None)  # hooks are counted apart
    assert tree() == seen[-1]
    changes = [
        lambda: setattr(model[0], "weight", torch.nn.Parameter(torch.zeros(4, 4))),
        lambda: setattr(model[0], "bias", None),  # torch skips its registration hooks for None
        lambda: model[1]._parameters.__setitem__("weight", torch.nn.Parameter(torch.ones(4, 4))),
        lambda: model._buffers.__setitem__("scale", torch.zeros(1)),
        lambda: model.append(torch.nn.Identity()),
        lambda: model.__delitem__(2),
    ]
    for change in changes:
        change()
        seen.append(tree())
        assert seen[-1] != seen[-2], change


def _watchable() -> bool:
    """Where CPython's dict version tags work for the watch (3.11 and 3.12; 3.13 writes instance
    attributes without moving the tag and 3.14 moves none: the self-test refuses, every call scans)."""
    return sys.implementation.name == "cpython" and (3, 11) <= sys.version_info[:2] <= (3, 12)


@pytest.mark.skipif(not _watchable(), reason="CPython 3.11-3.12 dict version tags")
def test_the_watch_sees_every_write_to_what_the_scan_reads_and_nothing_else():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.LayerNorm(4)))
    modules = list(model.modules())

    def watch():
        w = _native.TreeWatch.snapshot([m.__dict__ for m in modules])
        assert w is not None and len(w) == 6 * len(modules)  # each __dict__ and its five dicts
        return w

    w = watch()
    with torch.no_grad():
        model(torch.ones(2, 4))  # a forward, reads and walks change nothing
    _ = (model[0].weight, list(model.parameters()), model.state_dict(), repr(model), model.training)
    model[0].weight.data = torch.zeros(4, 4)  # the same tensor object: the addresses' check sees memory
    assert w.unchanged()
    writes = [
        lambda: setattr(model[0], "forward", lambda x: x),
        lambda: object.__setattr__(model[0], "_extra", 1),
        lambda: delattr(model[0], "_extra"),
        lambda: setattr(model[0], "weight", torch.nn.Parameter(torch.zeros(4, 4))),
        lambda: setattr(model[0], "bias", None),
        lambda: model[0]._parameters.__setitem__("bias", torch.nn.Parameter(torch.ones(4))),
        lambda: model.register_buffer("scale", torch.ones(1)),
        lambda: model._buffers.pop("scale"),
        lambda: model[1].append(torch.nn.Identity()),
        lambda: model[1].__delitem__(1),  # ModuleList/Sequential deletes replace _modules
        lambda: model[1][0].register_forward_pre_hook(lambda m, a: None),
        lambda: model[1][0]._forward_pre_hooks.clear(),
        lambda: model[0].__dict__.update(_other=2),
        lambda: model.train(False),  # `training` is in the __dict__ too: a key's business, seen as a write
    ]
    for write in writes:
        write()
        assert not w.unchanged(), write
        w = watch()
        assert w.unchanged()


@pytest.mark.skipif(not _watchable(), reason="CPython 3.11-3.12 dict version tags")
def test_the_scan_is_reused_while_the_watch_holds_and_made_again_after_a_write(monkeypatch):
    model = _tree()
    modules = list(model.modules())
    scans = []
    real = _native.scan_module_dicts
    monkeypatch.setattr(_native, "scan_module_dicts", lambda d: scans.append(1) or real(d))
    scan = guards.HookScan(model, modules)
    first = scan.scan()
    assert scan.scan() == first and scan.scan() == first and len(scans) == 1
    handle = modules[4].register_forward_hook(lambda m, a, o: None)
    assert scan.scan()[0][0] == 1 and len(scans) == 2
    handle.remove()
    assert scan.scan()[0][:2] == (0, -1) and len(scans) == 3

    class Owned:  # our execution-device hook: kept by identity in a watched __dict__
        _ddo_owned = True

    modules[1]._hf_hook = Owned()
    scan.scan(), scan.scan()
    assert len(scans) == 4

    class Registry:  # a diffusers registry keeps its hooks in objects no watch covers: every call scans
        hooks: dict = {}

        def get_hook(self, name):
            return None

    modules[3]._diffusers_hook = Registry()
    scan.scan(), scan.scan()
    assert len(scans) == 6
    Registry.hooks = {"first_block_cache": object()}
    assert scan.scan()[1][1] is not None and "first_block_cache" in scan.scan()[1][1]


def test_a_hook_mapping_that_is_not_a_dict_is_never_watched():
    model = _tree()
    modules = list(model.modules())
    modules[2].__dict__["_forward_pre_hooks"] = types.MappingProxyType({})
    assert _native.TreeWatch.snapshot([m.__dict__ for m in modules]) is None
    scan = guards.HookScan(model, modules)
    scan.scan()
    assert scan._kept is None


def test_the_watch_keeps_no_dropped_model_alive():
    """A module's ``__dict__`` holds the offload's handle, which holds the kept watch of that
    ``__dict__``: the garbage collector must see through the watch."""
    import gc
    import weakref

    import ddo_blocks
    from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer

    model = tiny_flux_transformer()
    x = flux_inputs(model)
    handle = ddo_blocks.offload(model, vram_budget=ddo_blocks.minimum_budget(model), device="cpu")
    with torch.no_grad():
        for _ in range(3):
            model(**x)
    if _watchable():
        assert handle.engine.scheduler.hook_scan._kept is not None
    gone = weakref.ref(model)
    del model, handle
    gc.collect()
    assert gone() is None


def test_the_first_snapshots_from_many_threads_do_not_hang():
    import subprocess

    code = (
        "import sys, threading\n"
        "sys.setswitchinterval(1e-6)\n"
        "from ddo_blocks import _native\n"
        "ds = [{'_parameters': {}} for _ in range(100)]\n"
        "ts = [threading.Thread(target=_native.TreeWatch.snapshot, args=(ds,)) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
    )
    for _ in range(3):  # a fresh process each time: the self-test runs once per process
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
