"""Finding a component's *units*: the pieces streamed as one copy each.

A unit is normally one block of a repeated block list (an ``nn.ModuleList`` or ``nn.Sequential``
child such as ``transformer_blocks``, ``single_transformer_blocks``, ``blocks``, ``layers``,
``down_blocks``). Everything outside units (embedders, norms, heads) is small and stays resident.
A component with no repeated blocks is split into its leaf modules that own parameters.
The order found here is the definition order; the engine confirms the execution order on the first
call and never relies on this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Unit:
    """One streamed piece of a component."""

    index: int
    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    """(qualified name in the component, parameter), in ``named_parameters`` order."""

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.params)


def _owns_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _is_block_list(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.Sequential)) and sum(_owns_params(c) for c in m.children()) >= 2


GRANULARITIES = ("block", "child")
"""``block``: one unit per block of a block list. ``child``: one unit per parameter-owning child of
each block (attention, feed-forward, norms): smaller units, so smaller slots, a lower minimum budget
and more budget left for resident weights, at the cost of more (still large) copies per step."""


def find_unit_modules(module: nn.Module, granularity: str = "block") -> list[tuple[str, nn.Module]]:
    """The blocks of every repeated block list (or, with ``granularity="child"``, their
    parameter-owning children), outermost lists only, in definition order; else the leaf modules
    that own parameters."""
    found: list[tuple[str, nn.Module]] = []

    def add_callable(qual: str, m: nn.Module) -> None:
        # Containers are never called, so hooks on them never fire: their items are the units.
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            for n, c in m.named_children():
                if _owns_params(c):
                    add_callable(f"{qual}.{n}", c)
        else:
            found.append((qual, m))

    def add_block(qual: str, block: nn.Module) -> None:
        children = [(n, c) for n, c in block.named_children() if _owns_params(c)]
        direct = next(block.parameters(recurse=False), None) is not None
        if granularity == "child" and children and not direct:
            for n, c in children:
                add_callable(f"{qual}.{n}", c)
        else:
            add_callable(qual, block)

    def visit(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            qual = f"{prefix}{name}"
            if _is_block_list(child):
                for i, block in child.named_children():
                    if _owns_params(block):
                        add_block(f"{qual}.{i}", block)
            else:
                visit(child, qual + ".")

    visit(module, "")
    if found:
        return found
    leaves = [
        (name, m)
        for name, m in module.named_modules()
        if next(m.parameters(recurse=False), None) is not None and not any(True for _ in m.children())
    ]
    return leaves or ([("", module)] if _owns_params(module) else [])


def split_units(module: nn.Module, granularity: str = "block") -> tuple[list[Unit], list[tuple[str, nn.Parameter]]]:
    """Splits a component's parameters into units and always-resident leftovers.

    A parameter shared by two units, or by a unit and the rest of the model (tied weights), is
    kept resident, so that no slot ever holds a tensor another unit also needs.
    """
    unit_modules = find_unit_modules(module, granularity)
    owner_count: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        owner_count[id(p)] = owner_count.get(id(p), 0) + 1
    in_units: dict[int, int] = {}
    for _, m in unit_modules:
        for p in m.parameters():
            in_units[id(p)] = in_units.get(id(p), 0) + 1

    def streamable(p: nn.Parameter) -> bool:
        return in_units.get(id(p), 0) == 1 and owner_count[id(p)] == 1 and p.numel() > 0

    prefix_of = {id(m): name for name, m in module.named_modules()}
    units: list[Unit] = []
    taken: set[int] = set()
    for name, m in unit_modules:
        base = prefix_of.get(id(m), name)
        params = [
            (f"{base}.{pn}" if base else pn, p) for pn, p in m.named_parameters() if streamable(p)
        ]
        if params:
            units.append(Unit(len(units), name, m, params))
            taken.update(id(p) for _, p in params)
    leftovers = [(n, p) for n, p in module.named_parameters() if id(p) not in taken]
    return units, leftovers


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def span_elements(t: torch.Tensor) -> int:
    """Elements of storage a tensor reaches from its first element: ``numel`` for a contiguous or
    transposed tensor, fewer for an expanded one (stride 0), more for a strided slice."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def span_nbytes(t: torch.Tensor) -> int:
    """Bytes of storage a tensor reaches: what a slab or slot holds for it, so that its view there
    keeps the tensor's own strides (and the kernels it runs with stay the same)."""
    return span_elements(t) * t.element_size()


def flat_span(t: torch.Tensor) -> torch.Tensor:
    """The storage ``t`` reaches, as a 1-D contiguous tensor of its dtype (a view, no copy)."""
    return t.as_strided((span_elements(t),), (1,))


def strided_view(base: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``like``'s shape, dtype and strides at byte ``offset`` of the uint8 tensor ``base``."""
    region = base[offset : offset + span_nbytes(like)].view(like.dtype)
    return region.as_strided(like.shape, like.stride())


def geometry(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``t``'s shape, strides and dtype: what a view of ``t`` in a slab or slot
    is built from, whatever ``t`` is later pointed at."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def own_copy(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``t``'s values in fresh memory from PyTorch's allocator on ``device`` (default: ``t``'s), with
    ``t``'s shape and strides, at an address as aligned as any tensor PyTorch allocates."""
    storage = torch.empty(span_elements(t), dtype=t.dtype, device=device or t.device)
    if storage.numel():
        storage.copy_(flat_span(t))
    return storage.as_strided(t.shape, t.stride())
