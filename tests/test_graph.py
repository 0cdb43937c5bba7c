"""``graph=True`` (CUDA-graph replay of steady calls) on the CPU: the option and its refusals, the
report, and the runner's bookkeeping (signatures, one graph per start state of the slots, the
scheduler's state after a replay, a failed capture) with a backend that re-runs the captured call
instead of replaying a graph. The replay itself runs in tests/test_gpu_graph.py."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_leaves

import ddo_blocks
from ddo_blocks.streaming.graph import GraphRunner
from ddo_blocks.tiny import flux_inputs, tiny_flux_transformer


class RerunGraphs:
    """A stand-in for ``torch.cuda.CUDAGraph`` on the CPU engine: a capture runs the call's Python
    (the scheduler's state moves on, as in a capture) but leaves the slots' memory as it was (a
    capture runs nothing), and keeps the outputs; a replay runs the call again from the state the
    capture started in and writes its outputs into the kept ones (as a graph writes its own)."""

    def __init__(self, engine, fail: BaseException | None = None):
        self.engine = engine
        self.fail = fail

    def capture(self, body, stream):
        if self.fail is not None:
            raise self.fail
        slots = self.engine.slots.storage
        before = slots.clone()
        start = self.engine.scheduler.inflight_state()
        out = body()
        slots.copy_(before)
        return (body, out, start), out

    def replay(self, graph):
        body, kept, start = graph
        self.engine.scheduler.set_inflight(start)
        for dst, src in zip(tree_leaves(kept), tree_leaves(body())):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


def _runner(handle, fail=None):
    sched = handle.engine.scheduler
    runner = GraphRunner(sched, handle.engine, backend=RerunGraphs(handle.engine, fail))
    runner.off_reason = None  # the CPU engine has no graphs: the stand-in takes their place
    sched.graph = runner
    return runner


def _offloaded(flux, fail: BaseException | None = None):
    """Inputs, the resident output, and the model offloaded at its minimum with graph=True on the
    stand-in backend: ``(x, ref, handle, runner)``."""
    x = flux_inputs(flux)
    ref = _reference(flux, x)
    handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu", graph=True)
    return x, ref, handle, _runner(handle, fail)


def _reference(model, x):
    with torch.no_grad():
        return model(**x)[0]


def test_graph_on_the_cpu_runs_eagerly_and_says_why(flux):
    x = flux_inputs(flux)
    ref = _reference(flux, x)
    handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu", graph=True)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(flux(**x)[0], ref)
    section = handle.report()["graph"]
    assert section["status"].startswith("off: CUDA graphs need a CUDA device"), section
    assert section["replays"] == 0 and section["captures"] == 0
    handle.remove()


def test_graph_must_be_a_bool(flux):
    with pytest.raises(ddo_blocks.ConfigError, match="graph='yes'"):
        ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu", graph="yes")
    assert all(p.device.type == "cpu" for p in flux.parameters())


@pytest.mark.parametrize("preset", ["low_ram_safe"])
def test_graph_with_a_staging_ring_is_off_with_the_reason(flux, preset):
    handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu", graph=True,
                                preset=preset)
    why = handle.engine.graph_blocker()
    assert why is not None  # on the CPU: no CUDA device; the store's own reason is checked below
    assert "staging ring" in handle.engine.store.graph_blocker()
    handle.remove()


@pytest.mark.parametrize("units, states", [("child", 1), ("block", 2)])
def test_replays_are_exact_and_cycle_through_the_slot_states(flux, units, states):
    x = flux_inputs(flux)
    ref = _reference(flux, x)
    handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux, units=units), device="cpu",
                                graph=True, units=units)
    runner = _runner(handle)
    n, k = len(handle.engine.streamed), handle.engine.slots.n_slots
    assert k // math.gcd(n, k) == states, (n, k)  # the slot mapping turns by n mod k each call
    with torch.no_grad():
        outs = [flux(**x)[0] for _ in range(10)]
    for out in outs:
        assert torch.equal(out, ref)
    section = handle.report()["graph"]
    assert section["captures"] == states, (section, n, k)
    assert section["replays"] == 10 - 3, section  # three eager warm-up calls
    assert section["status"] == "replaying"
    assert section["host_replay_s"] is not None and section["host_launch_s"] is not None
    # a call's host time holds its key and checks and the replay, which holds the launch
    assert section["host_call_s"] >= section["host_replay_s"] >= section["host_launch_s"] > 0
    phases = section["host_phases_s"]
    assert set(phases) == {"signature", "hooks", "state", "inputs", "launch", "rest"}, phases
    assert min(phases.values()) >= 0 and phases["signature"] > 0 and phases["hooks"] > 0, phases
    assert phases["launch"] == section["host_launch_s"] and phases["inputs"] > 0, phases
    # the scheduler is where an eager call would have left it
    assert len(handle.engine.scheduler.inflight_state()[0]) == k
    assert runner.stats.eager_calls == 3
    # the outputs are the caller's: a later call does not overwrite an earlier output
    assert outs[5] is not outs[6] and torch.equal(outs[5], ref)
    handle.remove()


def test_new_input_shapes_drop_the_graphs_and_stay_exact(flux):
    x, y = flux_inputs(flux), flux_inputs(flux, height=4, width=4, seed=3)
    rx, ry = _reference(flux, x), _reference(flux, y)
    handle = ddo_blocks.offload(flux, vram_budget=ddo_blocks.minimum_budget(flux), device="cpu", graph=True)
    runner = _runner(handle)
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(flux(**x)[0], rx)
        assert runner.stats.replays > 0
        for _ in range(4):
            assert torch.equal(flux(**y)[0], ry)
        assert runner.reason is None  # replaying the new shapes again
        assert torch.equal(flux(**x)[0], rx)
    assert runner.stats.captures >= 2
    handle.remove()


def test_call_structure_flattens_as_pytree_does_and_outputs_clone_alike():
    """The runner's own flattening of an all-leaf call keeps pytree's leaf order, rebuilds the call,
    and tells structures apart; a call holding a container goes through pytree. Outputs clone to equal,
    distinct tensors in the structure they came in."""
    from torch.utils import _pytree as pytree

    from ddo_blocks.streaming.graph import _clone_outputs, _FlatSpec, _flatten, _unflatten

    a, b = torch.ones(2), torch.zeros(3)
    args, kwargs = (a,), {"y": b, "flag": True, "n": None}
    leaves, spec = _flatten(args, kwargs)
    assert isinstance(spec, _FlatSpec)
    assert [id(x) for x in leaves] == [id(x) for x in pytree.tree_flatten((args, kwargs))[0]]
    back_args, back_kwargs = _unflatten(leaves, spec)
    assert back_args == args and list(back_kwargs) == list(kwargs) and back_kwargs["y"] is b
    # keyword order, a keyword more, positional against keyword: other structures
    assert _flatten(args, {"flag": True, "y": b, "n": None})[1] != spec
    assert _flatten(args, {**kwargs, "m": 1})[1] != spec
    assert _flatten((), {"x": a, **kwargs})[1] != spec
    # a container (or a tensor subclass) takes pytree's path, and round-trips
    nested_args, nested_kwargs = (a,), {"ys": [b, b], "flag": False}
    leaves, spec = _flatten(nested_args, nested_kwargs)
    assert not isinstance(spec, _FlatSpec) and len(leaves) == 4
    assert _unflatten(leaves, spec) == (nested_args, nested_kwargs)
    for out in (a, (a, b), [a, {"k": b}], (a, 3)):
        cloned = _clone_outputs(out)
        assert type(cloned) is type(out)
        got, want = pytree.tree_leaves(cloned), pytree.tree_leaves(out)
        assert all((g is w) if not isinstance(w, torch.Tensor) else (torch.equal(g, w) and g is not w)
                   for g, w in zip(got, want, strict=True))


def test_a_failed_capture_runs_the_call_eagerly_and_turns_graphs_off(flux):
    x, ref, handle, _ = _offloaded(flux, fail=RuntimeError("operation not permitted when stream is capturing"))
    with torch.no_grad():
        for _ in range(6):
            assert torch.equal(flux(**x)[0], ref)
    section = handle.report()["graph"]
    assert section["capture_failures"] == 1 and section["replays"] == 0
    assert "operation not permitted" in section["status"] and section["status"].startswith("off:")
    handle.remove()
    assert all(p.device.type == "cpu" for p in flux.parameters())


def test_an_input_that_changes_every_call_is_never_captured(flux):
    x, ref, handle, runner = _offloaded(flux)
    with torch.no_grad():
        for i in range(6):
            assert torch.equal(flux(**{**x, "return_dict": bool(i % 2)})[0], ref)
    assert runner.stats.replays == 0 and runner.stats.captures == 0
    assert "warming up" in runner.reason
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(flux(**{**x, "return_dict": False})[0], ref)
    assert runner.stats.replays == 1  # the same value twice: the second call is captured and replayed
    handle.remove()


def test_a_stateful_diffusers_hook_makes_calls_eager_with_the_reason(flux):
    from diffusers.hooks import HookRegistry, ModelHook

    x, ref, handle, runner = _offloaded(flux)
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(flux(**x)[0], ref)
        assert runner.stats.replays > 0
        registry = HookRegistry.check_if_exists_or_initialize(flux.transformer_blocks[0])
        registry.register_hook(ModelHook(), "counts_steps")  # a cache hook would change the call step by step
        replays = runner.stats.replays
        for _ in range(3):
            assert torch.equal(flux(**x)[0], ref)
    assert runner.stats.replays == replays
    assert "diffusers hooks on transformer_blocks.0 (counts_steps)" in runner.reason
    handle.remove()


@pytest.mark.parametrize("change", ["hook", "leaf_hook", "new_dict_hook", "removed_hook", "processor", "parameter",
                                    "new_parameter", "bias_none", "direct_write", "forward_override"])
def test_a_change_to_the_module_is_seen_and_captured_anew(flux, change):
    """What a graph bakes in and a user may change between calls: a forward hook on a block (it would
    never run again), on a module that had none, a hook removed (it would run for ever), an attention
    processor, a resident parameter pointed at other memory, a new parameter put in a resident one's
    place (``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``), a bias set to
    ``None`` (torch runs no registration hook for it), a direct ``_parameters`` write (accelerate's
    ``set_module_tensor_to_device``, ``torch.func.functional_call``), a forward set on an instance."""
    x, _, handle, runner = _offloaded(flux)
    seen = []
    early = flux.norm_out.register_forward_hook(lambda m, a, o: seen.append(0)) if change == "removed_hook" else None
    with torch.no_grad():
        for _ in range(5):
            flux(**x)
        assert runner.stats.replays > 0
        seen.clear()
        if change == "hook":
            flux.transformer_blocks[0].register_forward_hook(lambda m, a, o: seen.append(1))
        elif change == "leaf_hook":
            leaf = flux.transformer_blocks[0].attn.to_q
            assert not leaf._forward_hooks
            leaf.register_forward_hook(lambda m, a, o: seen.append(1))
        elif change == "new_dict_hook":  # code that clears hooks by giving a module a new dict
            leaf = flux.transformer_blocks[0].attn.to_k
            leaf._forward_hooks = collections.OrderedDict()
            leaf.register_forward_hook(lambda m, a, o: seen.append(1))
        elif change == "removed_hook":
            early.remove()
        elif change == "processor":
            attn = flux.transformer_blocks[0].attn
            attn.processor = type(attn.processor)()
        elif change == "parameter":
            resident = next(p for _, p in handle.engine.unit_plan.leftovers)
            resident.data = resident.data.clone()
        elif change == "forward_override":
            orig = flux.norm_out.forward
            flux.norm_out.forward = lambda *a, **k: orig(*a, **k) * 2
        else:
            pick = (lambda n: n.endswith(".bias")) if change == "bias_none" else (lambda n: True)
            name, resident = next((n, p) for n, p in handle.engine.unit_plan.leftovers if pick(n))
            owner, _, attr = name.rpartition(".")
            owner = flux.get_submodule(owner)
            new = torch.nn.Parameter(resident.detach() * 2, requires_grad=False)
            if change == "bias_none":
                owner.bias = None
            elif change == "direct_write":
                owner._parameters[attr] = new
            else:
                setattr(owner, attr, new)
        captures, eager = runner.stats.captures, runner.stats.eager_calls
        out = flux(**x)[0]
    assert runner.stats.eager_calls == eager + 1 and runner.stats.captures == captures  # not the old graph
    assert seen == ([1] if change.endswith("hook") and change != "removed_hook" else [])
    with torch.no_grad():
        ref = flux(**x)[0]
        for _ in range(2):
            assert torch.equal(flux(**x)[0], ref)
    assert torch.equal(out, ref)
    assert runner.stats.captures > captures  # captured anew with the change in it
    handle.remove()


def test_a_swapped_submodule_turns_graphs_off_and_a_registration_elsewhere_does_not(flux):
    """A layer swapped for another after the offload is outside what the offload manages: graphs go
    off for good, with the reason. A parameter registered on a module of another model (one built
    between calls) changes nothing: the replays go on."""
    x, _, handle, runner = _offloaded(flux)
    with torch.no_grad():
        for _ in range(5):
            flux(**x)
        replays = runner.stats.replays
        assert replays > 0
        other = torch.nn.Linear(4, 4)  # another model's registrations
        other.extra = torch.nn.Parameter(torch.zeros(2))
        flux(**x)
        assert runner.stats.replays == replays + 1 and runner.off_reason is None
        leaf = flux.norm_out.linear
        flux.norm_out.linear = torch.nn.Linear(leaf.in_features, leaf.out_features).requires_grad_(False)
        flux.norm_out.linear.load_state_dict(leaf.state_dict())
        ref = flux(**x)[0]
        assert "a submodule was added, removed or swapped" in runner.off_reason and runner.stats.replays == replays + 1
        for _ in range(2):
            assert torch.equal(flux(**x)[0], ref)
    assert "a submodule was added, removed or swapped" in handle.report()["graph"]["status"]
    handle.remove()


@pytest.mark.parametrize("change", ["buffer_in_forward", "swap_before_first_call"])
def test_a_change_that_keeps_graphs_off_from_the_start(flux, change):
    """A buffer reassigned at every call (here by a pre-hook, as some rotary embeddings do in their
    forward) would give every call a new key: once is a lazily made cache, twice turns graphs off. A
    submodule swapped between offload() and the first call is swapped after the offload too."""
    x, _, handle, runner = _offloaded(flux)
    if change == "buffer_in_forward":
        flux.norm_out.register_buffer("cache", torch.zeros(1), persistent=False)
        flux.norm_out.register_forward_pre_hook(lambda m, a: setattr(m, "cache", torch.zeros(1)))
        why = "in its own tree in its forward"
    else:
        leaf = flux.norm_out.linear
        flux.norm_out.linear = torch.nn.Linear(leaf.in_features, leaf.out_features).requires_grad_(False)
        why = "a submodule was added, removed or swapped"
    with torch.no_grad():
        ref = flux(**x)[0]
        for _ in range(5):
            assert torch.equal(flux(**x)[0], ref)
    assert runner.stats.replays == 0 and why in runner.off_reason
    handle.remove()


def test_a_cache_that_grows_now_and_then_keeps_the_graphs(flux):
    """A buffer made anew only when the input grows (a rotary cache sized to the longest input so
    far): once, then replays, then once more on a larger input, is not a forward that changes its tree
    at every call."""
    x, _, handle, runner = _offloaded(flux)
    seen = {"n": 0}
    flux.norm_out.register_buffer("cache", torch.zeros(1), persistent=False)

    def grow(module, args):
        n = args[0].shape[1]
        if n > seen["n"]:
            seen["n"] = n
            module.cache = torch.zeros(n)

    flux.norm_out.register_forward_pre_hook(grow)
    big = flux_inputs(flux, height=16, width=16)
    with torch.no_grad():
        for inputs in (x, big):
            ref = _reference(flux, inputs)
            replays = runner.stats.replays
            for _ in range(6):
                assert torch.equal(flux(**inputs)[0], ref)
            assert runner.stats.replays > replays and runner.off_reason is None
    handle.remove()


def test_a_streamed_parameter_assigned_new_values_keeps_the_graph(flux):
    """A user's ``p.data = ...`` on a streamed parameter writes its values into the unit's host copy
    (``streaming/edits.py``), which the graph's copies read: the replay computes with them, and the
    graph stays."""
    x, ref, handle, runner = _offloaded(flux)
    edited = tiny_flux_transformer()
    with torch.no_grad():
        for _ in range(5):
            flux(**x)
        captures, replays = runner.stats.captures, runner.stats.replays
        assert replays > 0
        name, p = handle.engine.streamed[0].params[0]
        p.data = torch.zeros_like(p.data)
        edited.get_parameter(name).zero_()
        out = flux(**x)[0]
        want = edited(**x)[0]
    assert runner.stats.captures == captures and runner.stats.replays == replays + 1
    assert torch.equal(out, want) and not torch.equal(out, ref)
    handle.remove()


class _FakeGenerator:
    def __init__(self):
        self.offset = 0

    def get_offset(self):
        return self.offset


class _FakeTorchGraph:
    _keep_graph = True

    def __init__(self, gen, draws):
        self.gen, self.draws, self.replays = gen, draws, 0

    def replay(self):
        self.replays += 1
        self.gen.offset += 4 * self.draws

    def raw_cuda_graph(self):
        return 1234


@pytest.mark.parametrize("case", ["fast", "draws", "refused", "other_error", "user_generators", "interrupt"])
def test_device_launch_serves_only_graphs_it_replays_alike(monkeypatch, case):
    """``TorchGraphs.replay``: the first replay is torch's; then device launch, unless that replay
    moved the generator's offset, the driver refused the graph (any exception: never out of the
    replay, which already ran), or this torch lets a capture draw from other generators."""
    from ddo_blocks.streaming import graph as G

    gen = _FakeGenerator()
    launches = []

    class FakeDeviceGraph:
        def __init__(self, raw, index, stream):
            assert raw == 1234
            if case == "refused":
                raise ddo_blocks.CudaError("cuGraphInstantiateWithFlags: CUDA_ERROR_NOT_SUPPORTED")
            if case == "other_error":
                raise RuntimeError("something else")
            if case == "interrupt":
                raise KeyboardInterrupt

        def launch(self, stream):
            launches.append(stream)

    monkeypatch.setattr(torch.cuda, "default_generators", (gen,))
    monkeypatch.setattr(G._native, "DeviceGraph", FakeDeviceGraph)
    monkeypatch.setattr(G, "_raw_stream", lambda device: 7)
    monkeypatch.setattr(G, "_user_generators_capture", lambda device: case == "user_generators")
    backend = G.TorchGraphs.__new__(G.TorchGraphs)  # no pool: nothing is captured here
    backend.device_launch = None
    torch_graph = _FakeTorchGraph(gen, draws=case == "draws")
    graph = G._Graph(torch_graph, torch.device("cuda", 0), kept=True)
    if case == "interrupt":  # decided before the second replay launches anything
        backend.replay(graph)
        with pytest.raises(KeyboardInterrupt):
            backend.replay(graph)
        assert torch_graph.replays == 1 and launches == []
        return
    for _ in range(4):
        backend.replay(graph)
    if case == "fast":
        assert torch_graph.replays == 1 and launches == [7, 7, 7] and backend.device_launch is None
    else:
        assert torch_graph.replays == 4 and launches == [] and graph.fast is None
        expected = {"draws": "draws random numbers", "refused": "CudaError", "other_error": "RuntimeError",
                    "user_generators": "any torch.Generator"}[case]
        assert expected in backend.device_launch, backend.device_launch


def test_input_copy_moves_the_bits_of_mixed_dtypes_in_one_view():
    """The static inputs get the call's bits exactly, each dtype seen as one (NaN payloads, -0.0,
    0-dim and bool tensors, an empty one); a static tensor passed back is not copied onto itself;
    an input at an odd offset, which no int16 view takes, is copied as it is."""
    from ddo_blocks.streaming.graph import InputCopy

    g = torch.Generator().manual_seed(0)
    def bits(*words: int) -> torch.Tensor:
        return torch.from_numpy(np.array(words, dtype=np.uint32).view(np.float32))

    nan_payload = bits(0x7FC12345, 0xFFA00001, 0x80000000)  # two NaNs with payloads, -0.0
    calls = [[torch.randn(3, 5, generator=g).to(torch.bfloat16), nan_payload + 0, torch.tensor(2.5), 7,
              torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.empty(0, 4)] for _ in range(3)]
    static = [x.clone() if isinstance(x, torch.Tensor) else None for x in calls[0]]
    copier = InputCopy(static)
    assert copier.dtype is torch.int16 and copier.indices == [0, 1, 2, 4]
    for leaves in calls[1:]:
        leaves[1] = bits(0x7F812345, 0x00000001, 0xFF800000)  # a signalling NaN, a denormal, -inf
        copier.copy(leaves)
        for s, x in zip(static, leaves):
            if isinstance(x, torch.Tensor) and x.numel():
                assert torch.equal(s.view(torch.uint8), x.view(torch.uint8)) if s.dim() else torch.equal(s, x)
    copier.copy([static[0], *calls[2][1:]])  # the static tensor itself: the others still land
    assert torch.equal(static[4], calls[2][4])

    flags = [torch.tensor([True, False]), torch.zeros(3, dtype=torch.bfloat16)]
    byte_copier = InputCopy([t.clone() for t in flags])
    assert byte_copier.dtype is torch.uint8
    byte_copier.copy([torch.tensor([False, True]), torch.ones(3, dtype=torch.bfloat16)])
    assert byte_copier.static[0].tolist() == [False, True] and byte_copier.static[1].tolist() == [1, 1, 1]

    strided = InputCopy([torch.zeros(4, dtype=torch.float32), torch.zeros(2, dtype=torch.bfloat16)])
    src = torch.arange(8, dtype=torch.float32)[::2]  # no int16 view of a strided last dimension
    strided.copy([src, torch.ones(2, dtype=torch.bfloat16)])
    assert torch.equal(strided.static[0], src) and strided.static[1].tolist() == [1, 1]
