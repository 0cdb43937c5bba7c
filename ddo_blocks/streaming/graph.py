"""CUDA-graph replay of a streamed component's calls (``graph=True`` on the linear route).

After a few eager calls (the order learned on the first, the calibration on the second, one steady
call), a call whose inputs have the same shapes, dtypes and non-tensor values as the one before is
captured into a CUDA graph: the model's kernels, every fetch into a slot on the copy stream (forked
from the capturing stream and joined back), the events between them. Later calls with the same
inputs replay the graph: no Python hook, no launch from the host, the same kernels on the same
addresses, so the outputs are the eager ones bit for bit.

What makes the replay right:

- **The slots' state.** A call starts with the first units of the order in flight in some slots and
  ends with the next call's first units in flight, maybe in other slots (``K`` slots, ``n`` units:
  the mapping turns by ``n mod K``). A graph is kept per start state (the in-flight units, their
  slots, the next unit to fetch): at most ``K`` graphs, replayed in turn, each ending where the next
  starts. The scheduler's state is set to the graph's end state after each replay.
- **Fences.** Events recorded inside a capture stand for graph nodes: nothing outside may wait on
  them. So after a capture, finished or failed, the device is waited for once, every slot's events
  are recorded again and the scheduler is set back to what the device holds (nothing a capture
  queued ran). Before a replay the launch stream waits for the in-flight units' arrival (fetched by
  an eager call, or by the previous replay: then the wait is already met); after it, every slot is
  marked consumed and arrived on the launch stream (``Transport.fence_slots``), so an eager fetch or
  call after a replay waits for the graph.
- **Inputs and outputs.** Tensor inputs are copied into static tensors the graph reads; outputs are
  the graph's own tensors, cloned before they are returned (a pipeline may keep one output while it
  calls again: classifier-free guidance).
- **The key** of a call: its entry point; its inputs' shapes, strides and dtypes and its plain
  values; the grad, inference, autocast and training modes; and what of the module a graph bakes in
  (every forward hook in the tree, each resident parameter's and buffer's memory, each attention
  processor). A tensor put in a resident one's place (``module.weight = nn.Parameter(...)``, ``bias
  = None``, a direct ``_parameters`` write, ``torch.func.functional_call``) changes the hook scan's
  hash of the tree's tensors and layers by identity, and the key's tensors are listed again; a
  submodule added, removed or swapped turns graphs off for the component, with the reason, as does a
  forward that puts new tensors in its own tree at every call (a buffer reassigned in forward). A different
  key drops the graphs and runs eagerly, as do a scheduler not in a steady state, a changed order, an
  input on another device or of another kind, and diffusers hooks (they change calls step by step).
  A failed capture (a host sync, a data-dependent branch, an allocation the graph cannot make) runs
  the call eagerly, turns graphs off for the component and says why in the report. Not seen: state
  inside a layer that no key covers (a LoRA scale set in place): offload again after such a change.

The backend is PyTorch's ``torch.cuda.CUDAGraph`` (one private memory pool per input signature,
shared by that signature's graphs); the CPU engine has none (the report says so), and the tests
give the runner a backend that re-runs the captured call instead.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import _native

WARMUP_CALLS = 3
"""Calls a component runs eagerly before its first capture: the order is learned on the first, the
calibration runs on the second, the third is a steady call."""

MAX_HOST_TIMES = 256
"""Replays whose host time the report keeps (the most recent)."""


@dataclass
class Captured:
    """One graph: the call from one start state of the slots to its end state."""

    graph: Any
    start: tuple
    end: tuple
    out: Any
    """The graph's own outputs (a pytree as the module returned it)."""
    h2d_bytes: int
    replays: int = 0


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager_calls: int = 0
    failures: int = 0
    host_s: list[float] = field(default_factory=list)
    launch_s: list[float] = field(default_factory=list)
    call_s: list[float] = field(default_factory=list)
    signature_s: list[float] = field(default_factory=list)
    """Per replayed call: the inputs' flattening and signature (shapes, dtypes, modes)."""
    hooks_s: list[float] = field(default_factory=list)
    """Per replayed call: the hook scan (``guards.HookScan``: the watch of the tree's dicts)."""
    state_s: list[float] = field(default_factory=list)
    """Per replayed call: the module's state in the key (the resident tensors' addresses, the
    processors), the key's comparison and the slots' state, up to the replay."""
    inputs_s: list[float] = field(default_factory=list)
    """Per replayed call: the copy of the inputs into the static tensors."""

    def keep(self, **times: float) -> None:
        for name, value in times.items():
            kept = getattr(self, name)
            kept.append(value)
            del kept[:-MAX_HOST_TIMES]


class TorchGraphs:
    """``torch.cuda.CUDAGraph`` capture and replay, a private memory pool per input signature.

    Where torch keeps the captured graph (``keep_graph=True``, torch 2.6 and later), each graph is
    also instantiated for device launch (``_native.DeviceGraph``): the same nodes, launched from the
    host in a few microseconds where torch's launch costs about 1.7 us per copy node and 1.3 us per
    memset node on the H200 (0.17-0.46 ms a call for Flux's module tree). The first replay of a
    graph is torch's. Its executable for device launch serves the later ones only where nothing
    torch's replay does beside the launch matters: torch's replay also advances the generators the
    graph draws from, which a launch of ours would not, so a graph whose first replay moved the
    default generator's offset keeps torch's replay, and so does every graph where this torch lets a
    capture draw from a generator of the user's (:func:`_user_generators_capture`: their offsets are
    out of sight). A graph that streams units keeps torch's replay too: launched for the device, the
    Flux-sized step at 512x512 and 16 GiB ran 1.5x slower than eager on the H200 (session 8), and
    1.38x slower on the device than the same graph launched by torch (session 15: its copies no
    longer overlapped the compute), so device launch serves graphs without copies (every unit
    resident). A graph the driver refuses
    keeps torch's replay. The decision is made before the second replay launches anything.
    :attr:`device_launch` says why not."""

    device_launch_copies = False
    """An experiment's switch (``benchmarks.graph_host --device-launch-copies``): device launch for
    graphs that stream units too."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.device_launch: str | None = None
        """``None`` while every graph replays by device launch, else why the last one does not."""

    def new_pool(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, body: Any, stream: torch.cuda.Stream) -> tuple[Any, Any]:
        try:
            g, kept = torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:  # a torch without it: torch's launch only
            g, kept = torch.cuda.CUDAGraph(), False
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                out = body()
        except BaseException:
            with contextlib.suppress(Exception):  # the capture's own error is the one to see
                repair_generator(stream.device)
            raise
        if kept and hasattr(g, "instantiate"):
            g.instantiate()  # torch's executable now, not in the first replay
        return _Graph(g, stream.device, kept), out

    def replay(self, graph: Any) -> None:
        if graph.replays == 1 and not graph.tried:
            # decided before this call launches anything: an error (or an interrupt) here leaves
            # the call unlaunched, as the runner then takes it
            graph.tried = True
            graph.fast, self.device_launch = _device_launch(graph, self.device_launch_copies)
        if graph.fast is not None:
            graph.fast.launch(_raw_stream(graph.device))
            return
        if graph.replays == 0:  # whether torch's replay advances the generator: read once
            gen = torch.cuda.default_generators[graph.device.index or 0]
            offset = gen.get_offset()
            graph.g.replay()
            graph.draws = gen.get_offset() != offset
        else:
            graph.g.replay()
        graph.replays += 1


@dataclass
class _Graph:
    g: Any
    """The ``torch.cuda.CUDAGraph``."""
    device: torch.device
    kept: bool
    """Whether torch keeps its graph (``keep_graph=True``), which device launch instantiates."""
    replays: int = 0
    """Replays by torch's launch."""
    draws: bool = False
    """Whether torch's first replay moved the default generator's offset."""
    tried: bool = False
    """Whether device launch was decided (before the second replay)."""
    fast: Any = None
    """The graph's executable for device launch, where it may serve."""
    copies: bool = False
    """Whether the graph fetches units (copies on the copy stream beside the compute)."""


def _raw_stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index or 0)


_USER_GENERATORS: dict[int, bool] = {}
"""Per device: whether this torch lets a capture draw from a generator nobody registered."""


def _user_generators_capture(device: torch.device) -> bool:
    """Whether a capture may draw random numbers from a user's ``torch.Generator`` that nobody
    registered (torch versions that register a generator lazily, when a capture first uses it):
    then torch's replay advances generators a graph's first replay does not show. Probed once per
    process and device, with captures of one draw: from the default generator (it must succeed),
    from a new generator (it must fail), and from that generator registered with the graph (it must
    succeed, so that the failure was the missing registration). Anything else answers yes: the
    probe cannot tell, and device launch is refused. A probe that failed for want of memory or for
    another error than the answer is not kept: the next graph asks again."""
    index = device.index or 0
    if index in _USER_GENERATORS:
        return _USER_GENERATORS[index]

    def captures(gen: torch.Generator | None, register: bool = False) -> bool:
        side = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        try:
            with warnings.catch_warnings(), torch.cuda.device(device):
                warnings.simplefilter("ignore")  # torch warns of the empty graph a refused draw leaves
                if register:
                    graph.register_generator_state(gen.graphsafe_get_state())
                with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                    torch.rand(1, device=device, generator=gen)
            return True
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception:  # noqa: BLE001 - refused
            with contextlib.suppress(Exception):
                repair_generator(device)
            return False

    try:
        if not captures(None):
            return True  # the probe itself cannot capture: no answer kept
        gen = torch.Generator(device=device)
        lazy = captures(gen)
        if not lazy and not (hasattr(torch.cuda.CUDAGraph, "register_generator_state") and captures(gen, True)):
            return True  # refused, but not for the registration: no answer kept
    except torch.cuda.OutOfMemoryError:
        return True
    _USER_GENERATORS[index] = lazy
    return lazy


def _device_launch(graph: _Graph, copies: bool = False) -> tuple[Any, str | None]:
    """The device-launch executable of ``graph`` after its first replay, or ``None`` and why not
    (``copies``: a graph that streams units too)."""
    if graph.draws:
        return None, "the graph draws random numbers (torch's replay advances their offset)"
    if graph.copies and not copies:
        return None, ("the graph streams units: launched for the device, the streamed step at 512x512 and 16 GiB "
                      "ran 1.38-1.5x slower on the H200 (its copies no longer overlapped the compute)")
    if not graph.kept or not hasattr(graph.g, "raw_cuda_graph"):
        return None, "this torch does not keep a captured graph (torch.cuda.CUDAGraph(keep_graph=True))"
    try:
        if _user_generators_capture(graph.device):
            return None, ("this torch lets a capture draw from any torch.Generator, whose offsets only torch's "
                          "replay advances")
        return _native.DeviceGraph(graph.g.raw_cuda_graph(), graph.device.index or 0,
                                   _raw_stream(graph.device)), None
    except Exception as exc:  # noqa: BLE001 - refused (the driver's reason): torch's launch, said why
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return None, f"device launch refused ({type(exc).__name__}: {first})"


def repair_generator(device: torch.device) -> None:
    """After a capture that failed: a capture that ends in an error can leave the device's default
    random generator marked as capturing (torch runs its epilogue only after a successful end), and
    every later random draw on the device then fails ("Offset increment outside graph capture
    encountered unexpectedly": the likely cause of that error in a later test of the same process on
    torch 2.11, after the failed-capture test; this repair has not run on a GPU yet).

    Probes the generator with its state saved and restored. When the probe fails, a trivial capture
    that ends well clears the mark on the same state object (graphs captured earlier keep theirs);
    should the probe still fail, the generator gets a fresh state with the same seed and offset."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    saved = gen.get_state()

    def draws() -> bool:
        try:
            torch.empty(1, device=device).uniform_()
        except torch.cuda.OutOfMemoryError:
            return True  # not the generator's fault
        except RuntimeError:
            return False
        return True

    try:
        if draws():
            return
        with (contextlib.suppress(Exception), torch.cuda.device(device),
              torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream(device))):  # not torch's shared one
            torch.empty(1, device=device).zero_()
        if not draws():
            fresh = torch.Generator(device=device)
            fresh.set_state(saved)
            gen.graphsafe_set_state(fresh)
    finally:
        gen.set_state(saved)  # the probes' draws leave no trace in the user's random numbers


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
"""Non-tensor inputs and outputs a graph can key on (by value) and return as they are."""


class _FlatSpec(NamedTuple):
    """The structure of a call whose arguments are all leaves (tensors and plain values, no
    containers), as most entry calls are: the positional count and the keywords in their order.
    :func:`_flatten` takes it without walking a pytree (some 70 us of a call's host time on the CI
    machine for Flux's keywords); calls with containers keep pytree's spec."""

    args: int
    keys: tuple[str, ...]


_LEAF_TYPES = frozenset((torch.Tensor, torch.nn.Parameter, *_PLAIN))


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """``(leaves, spec)`` of a call as ``pytree.tree_flatten((args, kwargs))`` orders its leaves
    (positional, then keywords in their order), the spec a :class:`_FlatSpec` where every argument is a
    leaf of an exact tensor or plain type, else pytree's."""
    leaves = [*args, *kwargs.values()]
    if all(type(x) in _LEAF_TYPES for x in leaves):
        return leaves, _FlatSpec(len(args), tuple(kwargs))
    return pytree.tree_flatten((args, kwargs))


def _unflatten(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    """The call's ``(args, kwargs)`` from :func:`_flatten`'s leaves and spec."""
    if isinstance(spec, _FlatSpec):
        return tuple(leaves[: spec.args]), dict(zip(spec.keys, leaves[spec.args :]))
    return pytree.tree_unflatten(leaves, spec)


def _clone_outputs(out: Any) -> Any:
    """The graph's outputs cloned (the next replay writes them again): a tensor or a tuple of tensors
    (a diffusers model called with ``return_dict=False``) directly, anything else through pytree."""
    if type(out) is torch.Tensor:
        return out.clone()
    if type(out) is tuple and all(type(t) is torch.Tensor for t in out):
        return tuple(t.clone() for t in out)
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def _autocast() -> tuple:
    try:
        return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    except (TypeError, AttributeError, RuntimeError):  # an older torch: the global flag
        return (torch.is_autocast_enabled(),)


def _signature(leaves: list[Any], spec: Any, device: torch.device, module: nn.Module) -> tuple[Any, str | None]:
    """The call's key (tensors by shape, strides and dtype; plain values by value; the grad, inference,
    autocast and training modes), or ``None`` and why the call cannot be replayed."""
    parts: list[Any] = [spec, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _autocast(),
                        module.training]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.device != device:
                return None, f"an input tensor is on {x.device}, not on {device} (a graph reads device memory only)"
            if x.requires_grad and torch.is_grad_enabled():
                return None, "an input requires grad (a graph replays inference only)"
            parts.append((tuple(x.shape), x.stride(), x.dtype))
        elif isinstance(x, _PLAIN):
            parts.append((type(x), x))
        else:
            return None, (f"an input of type {type(x).__name__} (neither a tensor nor a plain value: a graph would not "
                          "see it change)")
    return tuple(parts), None


class InputCopy:
    """Copies a call's input tensors into a graph's static ones in one dispatch of
    ``torch._foreach_copy_``. That dispatch takes its fast route (one multi-tensor kernel) only when
    every tensor has one dtype; a call's inputs mix them (Flux: bf16 latents and embeddings, a
    float32 guidance), and the per-tensor route is a dispatch and a copy launch per tensor (0.1 ms
    of a replayed call's host time for Flux's seven on the H200 under a profiler; 0.04 ms so). So
    where the static tensors are contiguous and of several dtypes, each pair is copied as its bytes
    seen as one dtype (``int16`` where every element is 2 bytes or more, else ``uint8``): the same
    bits land, NaN payloads included. A source no such view takes (a strided last dimension) is
    copied as it is. Pairs where the input is the static tensor itself, or empty, are skipped."""

    def __init__(self, static: list[torch.Tensor | None]):
        self.indices = [i for i, s in enumerate(static) if s is not None and s.numel() > 0]
        self.static: list[torch.Tensor] = [static[i] for i in self.indices]  # type: ignore[misc]
        self.dtype: torch.dtype | None = None
        if (len({s.dtype for s in self.static}) > 1
                and all(type(s) is torch.Tensor and s.is_contiguous() for s in self.static)):
            self.dtype = torch.int16 if min(s.element_size() for s in self.static) >= 2 else torch.uint8
        self.dst = [self._bytes(s) for s in self.static] if self.dtype is not None else self.static

    def _bytes(self, t: torch.Tensor) -> torch.Tensor:
        assert self.dtype is not None
        return (t if t.dim() > 0 else t.view(1)).view(self.dtype)

    def copy(self, leaves: list[Any]) -> None:
        # a static tensor passed back is not copied onto itself
        ks = [k for k, i in enumerate(self.indices) if leaves[i] is not self.static[k]]
        if not ks:
            return
        src = [leaves[self.indices[k]] for k in ks]
        if self.dtype is not None:
            try:
                seen = [self._bytes(x) for x in src]
            except RuntimeError:  # a source not viewable so (a strided last dimension): each as it is
                pass
            else:
                torch._foreach_copy_([self.dst[k] for k in ks], seen)
                return
        torch._foreach_copy_([self.static[k] for k in ks], src)


_PROCESSOR = operator.attrgetter("processor")

_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class Addresses:
    """The memory of the tensors a graph reads where they are (the resident parameters and buffers):
    their addresses when listed, checked every call in one call into torch
    (``torch._C._tensors_data_ptrs_at_indices_equal``, the check of torch's own cudagraph trees; a
    loop over ``data_ptr`` where torch lacks it), and a generation that moves when one moved (a
    ``.data`` or ``set_`` put other memory in place; the tensor objects themselves are the tree
    hash's business)."""

    def __init__(self, tensors: list[torch.Tensor], generation: int = 0):
        self.tensors = tensors
        self.ptrs = self._read()
        self.indices = list(range(len(tensors)))
        self.generation = generation
        # torch's check reads the C++ pointer: where a subclass answers data_ptr() otherwise, loop
        self._fast = _ptrs_equal is not None and bool(_ptrs_equal(self.tensors, self.ptrs, self.indices))

    def _read(self) -> list[int]:
        return list(map(torch.Tensor.data_ptr, self.tensors))  # unbound: the tensor's own memory

    def same(self) -> bool:
        if self._fast:
            return bool(_ptrs_equal(self.tensors, self.ptrs, self.indices))
        return self.ptrs == self._read()

    def check(self) -> int:
        """The generation, moved on (and the addresses taken again) if any address changed."""
        if not self.same():
            self.ptrs = self._read()
            self.generation += 1
        return self.generation


def _module_state(torch_hooks: tuple[int, int, int], addresses: Addresses, processors: list[nn.Module]) -> tuple:
    """What of the module a graph bakes in and a call could change: the forward hooks on every module
    (their count and the newest hook's id) and the tree's hash (``guards.HookScan``), the resident
    parameters' and buffers' memory (:class:`Addresses`), each attention processor's identity."""
    return (torch_hooks, addresses.check(), tuple(map(id, map(_PROCESSOR, processors))))


class GraphRunner:
    """Runs a streamed component's entry calls eagerly or as graph replays (see the module's text).
    Called by the scheduler's entry wrapper, under the component's lock, for calls at depth 0."""

    def __init__(self, scheduler: Any, engine: Any, backend: Any = None):
        self.scheduler = scheduler
        self.engine = engine
        self.device = engine.device
        self.stats = GraphStats()
        self.off_reason: str | None = engine.graph_blocker()
        """Why this component never captures (``None``: it may)."""
        self.reason: str | None = None
        """Why the last call ran eagerly (``None``: it was a replay, or graphs are off)."""
        if backend is None and self.off_reason is None:
            backend = TorchGraphs()
        self.backend = backend
        self._key: Any = None
        self._same_key_calls = 0
        self._static: list[torch.Tensor] | None = None
        self._copier: InputCopy | None = None
        self._graphs: dict[tuple, Captured] = {}
        self._side: torch.cuda.Stream | None = None
        self._last_done: Any = None
        self._tree: int | None = None
        """The tree hash (``guards.HookScan``) the tensor list below was made for."""
        self._changed_in_forward = 0
        """Eager calls in a row during which the module changed its own tree."""
        self._forwards: list[Any] = []
        self._rebound = {id(p) for u in scheduler.streamed for _, p in u.params}
        self._params = Addresses(self._resident_tensors())
        """The parameters and buffers whose memory the key holds: the resident ones (a streamed one is
        pointed at its slot by the engine, eagerly as in the graph, whatever it was pointed at)."""
        self._processors = [m for m in scheduler.modules if hasattr(m, "processor")]  # listed at install

    def _resident_tensors(self) -> list[torch.Tensor]:
        module = self.scheduler.module
        return ([p for p in module.parameters() if id(p) not in self._rebound]
                + [b for b in module.buffers() if b is not None])

    def _tree_changed(self, tree: int) -> str | None:
        """The tree hash moved (a tensor or a layer put in another's place, removed or added): lists
        the module's tensors again (a new one in a resident one's place changes the key's addresses),
        and says why graphs go off for good if its layers changed (a submodule added, removed or
        swapped: the offload does not manage it)."""
        self._tree = tree  # the first call too: the tree may have changed since the offload
        self._params = Addresses(self._resident_tensors(), self._params.generation + 1)
        # held, so that a replaced forward's address is never reused by the next one
        self._forwards = [m.__dict__.get("forward") for m in self.scheduler.modules]
        if any(a is not b for a, b in itertools.zip_longest(self.scheduler.module.modules(), self.scheduler.modules)):
            return ("a submodule was added, removed or swapped after the offload (the offload does not manage "
                    "it: an IP-Adapter's or a LoRA's layers): remove() and offload() the module again to replay "
                    "graphs")
        return None

    # ---------------------------------------------------------------------------------------------
    def call(self, method: Any, args: tuple, kwargs: dict) -> Any:
        t_call = time.perf_counter()
        sched = self.scheduler
        if self.off_reason is not None:
            return sched.eager_call(method, args, kwargs)
        leaves, spec = _flatten(args, kwargs)
        key, why = _signature(leaves, spec, self.device, sched.module)
        t_signature = time.perf_counter()
        if key is None:
            self._forget()
            self._key = None
            return self._eager(method, args, kwargs, why)  # its own checks scan the hooks
        torch_hooks, (on_top, stateful) = sched.hook_scan.scan()
        t_hooks = time.perf_counter()
        tree = sched.tree = torch_hooks[2]
        if tree != self._tree:
            swapped = self._tree_changed(tree)
            if swapped is not None:
                self.off_reason = swapped
                self._forget()
                return self._eager(method, args, kwargs, swapped)
        # the entry point and what of the module the graph would bake in
        key = (getattr(method, "__name__", ""), key, _module_state(torch_hooks, self._params, self._processors))
        if key != self._key:
            self._forget()
            self._key = key
        sched.refuse_on_top(on_top)
        if stateful is not None:
            self._forget()
            return self._eager(method, args, kwargs, f"{stateful} change what a call does from step to step")
        state = sched.inflight_state()
        captured = self._graphs.get(state)
        if captured is not None:
            return self._replay(captured, leaves, copy_inputs=True, marks=(t_call, t_signature, t_hooks))
        why = self._not_ready(state)
        if why is None:
            out = self._capture(method, leaves, spec, state)
            if out is not None:
                return out[0]
            why = self.reason
        self._same_key_calls += 1
        return self._eager_watched(method, args, kwargs, why, tree)

    def _eager_watched(self, method: Any, args: tuple, kwargs: dict, why: str | None, tree: int) -> Any:
        """An eager call that may lead to a capture: a forward that puts new tensors or layers in its
        own tree (a buffer reassigned in forward) would give every call a new key; seen on two eager
        calls in a row, graphs go off with the reason (once is a lazily made or grown cache)."""
        out = self._eager(method, args, kwargs, why)
        if self.off_reason is None:
            moved = self.scheduler.hook_scan.scan()[0][2] != tree
            self._changed_in_forward = self._changed_in_forward + 1 if moved else 0
            if self._changed_in_forward >= 2:
                self.off_reason = ("the module puts new tensors or layers in its own tree in its forward (a buffer "
                                   "reassigned at every call): a graph would replay the old ones")
                self._forget()
        return out

    def _eager(self, method: Any, args: tuple, kwargs: dict, why: str | None) -> Any:
        self.reason = why
        self.stats.eager_calls += 1
        orders = self.scheduler.stats.order_changes
        try:
            return self.scheduler.eager_call(method, args, kwargs)
        finally:
            if self.scheduler.stats.order_changes != orders:
                self._forget()  # a new order: the graphs replay the old one; one more steady call first

    def _not_ready(self, state: tuple) -> str | None:
        """Why a call in ``state`` is not captured now (``None``: capture it)."""
        sched = self.scheduler
        if sched._calls_started < WARMUP_CALLS or self._same_key_calls < 1:
            return "warming up (the order, the calibration, one steady call with the same inputs)"
        if sched._calibrating or (sched.calibration is not None and sched.calibration.end is None):
            return "warming up (the calibration call)"
        if not sched.last_call_clean:
            return "the last call did not finish cleanly"
        if self.engine.after_entry_call is not None:
            return "waiting for the first call's measurement (vram_budget='auto')"
        inflight, _, free = state
        if self.engine.streamed and (free or len(inflight) != self.engine.slots.n_slots):
            return "the slots are not in a steady state (a miss or a reorder in the last call)"
        if len(self._graphs) >= max(1, self.engine.slots.n_slots):
            return "as many graphs as slot states already: the order is not cyclic"
        return None

    # ---------------------------------------------------------------------------------------------
    def _capture(self, method: Any, leaves: list[Any], spec: Any, state: tuple) -> tuple[Any] | None:
        """Captures this call from ``state`` and replays it once for its outputs; ``None`` (with
        :attr:`reason`) when no graph came of it and the call is to run eagerly."""
        sched, engine = self.scheduler, self.engine
        cur = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._wait_last(cur)
        if self._static is None:
            self._static = [x.detach().clone(memory_format=torch.preserve_format) if isinstance(x, torch.Tensor)
                            else None for x in leaves]
            self._copier = InputCopy(self._static)
        else:
            self._copy_inputs(leaves)
        s_args, s_kwargs = _unflatten([s if s is not None else x for s, x in zip(self._static, leaves)], spec)
        if self.device.type == "cuda" and self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        if side is not None:
            side.wait_stream(cur)
            # The graph's pool takes a call's activations a second time, beside the blocks the eager
            # calls left cached: give those back first (a 2048x2048 capture under the auto budget ran
            # out of memory beside them on the H200; this has not run on a GPU since).
            torch.cuda.empty_cache()
        bytes0 = engine.bytes_moved()
        orders = sched.stats.order_changes

        def body() -> Any:
            copy = engine.copy_stream if side is not None else None
            if copy is not None:
                copy.wait_stream(side)  # fork: the copy stream joins the capture
            done = False
            try:
                out = sched.eager_call(method, s_args, s_kwargs, capturing=True)
                done = True
            finally:
                if copy is not None:
                    try:
                        side.wait_stream(copy)  # join: the graph ends after its last fetch
                    except Exception:  # an invalidated capture: the call's own error is the one to see
                        if done:
                            raise
            return out

        failure = None
        try:
            engine.begin_capture(side)
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                graph, out = self.backend.capture(body, side)
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager from here, said why
            failure = f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
        finally:
            try:
                end = sched.inflight_state()
                moved = engine.bytes_moved() - bytes0
                engine.graph_bytes -= moved  # counted as fetched, but a capture moves nothing: the replays do
                sched.restore_slots(state)  # the device holds what it held before the capture
            finally:
                engine.end_capture()
        if failure is not None:
            self._failed(failure)
            return None
        if sched.stats.order_changes != orders or not sched.last_call_clean:
            self._failed("the order changed during the capture", permanent=False)
            return None
        odd = next((type(x).__name__ for x in pytree.tree_leaves(out) if not isinstance(x, (torch.Tensor, *_PLAIN))),
                   None)
        if odd is not None:
            self._failed(f"the output holds a {odd}, which a replay could not give back as the eager call does")
            return None
        if isinstance(graph, _Graph):
            graph.copies = moved > 0
        captured = Captured(graph, state, end, out, moved)
        self._graphs[state] = captured
        self.stats.captures += 1
        return (self._replay(captured, leaves, copy_inputs=False),)

    def _failed(self, why: str, permanent: bool = True) -> None:
        """After a capture that gave no graph (the scheduler is back where the device is)."""
        self.stats.failures += 1
        self.reason = why
        if permanent:
            self.off_reason = why
        self._forget()

    def _wait_last(self, stream: Any) -> None:
        """The stream waits for the previous replay's outputs to be cloned before the static tensors
        are written again (calls may come on different streams)."""
        if stream is not None and self._last_done is not None:
            stream.wait_event(self._last_done)

    def _copy_inputs(self, leaves: list[Any]) -> None:
        """Copies the call's tensors into the static inputs the graph reads (every call: a tensor may
        have been written in place in ways its version counter does not see, ``.data`` writes)."""
        assert self._copier is not None
        self._copier.copy(leaves)

    def _replay(self, captured: Captured, leaves: list[Any], copy_inputs: bool,
                marks: tuple[float, float, float] | None = None) -> Any:
        """Replays ``captured``; ``marks``: when the call began, when its signature and when its hook
        scan were done (the key and the checks before the replay count in the call's host time),
        ``None`` for the replay that ends a capture."""
        sched, engine = self.scheduler, self.engine
        t0 = time.perf_counter()
        sched.check_grad()  # the hooks were looked at in call()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        engine.call_started()
        try:
            t_inputs = time.perf_counter()
            if copy_inputs:
                self._wait_last(stream)
                self._copy_inputs(leaves)
            inputs_s = time.perf_counter() - t_inputs
            start = end = None
            if stream is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
            engine.before_replay(captured.start)
            launched = False
            try:
                t_launch = time.perf_counter()
                self.backend.replay(captured.graph)
                launch_s = time.perf_counter() - t_launch
                launched = True
            finally:
                if launched:  # the device holds the end state now, whatever comes next
                    sched.set_inflight(captured.end)
                    engine.after_replay()
            out = _clone_outputs(captured.out)
            if stream is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                self._last_done = end
        finally:
            engine.call_finished()
        engine.graph_bytes += captured.h2d_bytes
        captured.replays += 1
        self.stats.replays += 1
        self.reason = None
        host_s = time.perf_counter() - t0
        if captured.replays > 1:  # a graph's first launch uploads it: part of its capture, not a replay's cost
            self.stats.keep(host_s=host_s, launch_s=launch_s, inputs_s=inputs_s)
        call_s = time.perf_counter() - marks[0] if marks is not None else host_s
        if captured.replays > 1 and marks is not None:
            t_call, t_signature, t_hooks = marks
            self.stats.keep(call_s=call_s, signature_s=t_signature - t_call, hooks_s=t_hooks - t_signature,
                            state_s=t0 - t_hooks)
        sched.record_replay(start, end, captured.h2d_bytes, call_s)
        return out

    # ---------------------------------------------------------------------------------------------
    def _forget(self) -> None:
        """Drops the graphs and the static inputs (new inputs, a failure, the offload's removal), once
        the last replay finished (it may still read them, on another stream than the next call's)."""
        if not self._graphs and self._static is None:
            self._same_key_calls = 0
            return
        if self._last_done is not None:
            self._last_done.synchronize()
        self._graphs.clear()
        self._static = self._copier = None
        self._same_key_calls = 0
        if hasattr(self.backend, "new_pool"):
            self.backend.new_pool()

    def close(self) -> None:
        self._forget()
        self._side = None
        self._last_done = None

    def _device_launch(self) -> str | None:
        """``"yes"`` when every graph replays by device launch (:class:`TorchGraphs`), else why not."""
        graphs = [c.graph for c in self._graphs.values() if isinstance(c.graph, _Graph) and c.graph.tried]
        if not graphs:
            return None
        if all(g.fast is not None for g in graphs):
            return "yes"
        return "no: " + (getattr(self.backend, "device_launch", None) or "not for every graph")

    def _phases(self) -> dict[str, float] | None:
        """Where a replayed call's host time goes, medians: before the replay the signature, the hook
        scan and the module's state (:class:`GraphStats`); in it the inputs' copy, the launch, and the
        rest (the slots' waits and fences, the outputs' clones, the timing events)."""
        st = self.stats
        if not st.call_s or not st.host_s:
            return None
        med = statistics.median
        return {"signature": med(st.signature_s), "hooks": med(st.hooks_s), "state": med(st.state_s),
                "inputs": med(st.inputs_s), "launch": med(st.launch_s),
                "rest": max(0.0, med(st.host_s) - med(st.inputs_s) - med(st.launch_s))}

    def section(self) -> dict[str, Any]:
        host = self.stats.host_s
        return {
            "enabled": True,
            "status": ("off: " + self.off_reason) if self.off_reason else
                      ("replaying" if self.reason is None and self.stats.replays else
                       f"eager: {self.reason}" if self.reason else "waiting for the first calls"),
            "graphs": len(self._graphs),
            "captures": self.stats.captures,
            "replays": self.stats.replays,
            "eager_calls": self.stats.eager_calls,
            "capture_failures": self.stats.failures,
            "host_replay_s": statistics.median(host) if host else None,
            "host_launch_s": statistics.median(self.stats.launch_s) if self.stats.launch_s else None,
            "host_call_s": statistics.median(self.stats.call_s) if self.stats.call_s else None,
            "host_phases_s": self._phases(),
            "device_launch": self._device_launch(),
        }
