"""The device side of a streamed component: K slots the size of the largest streamed unit, allocated
once through PyTorch (so its allocator and memory statistics stay right), with every (unit, slot)
tensor view built once. Binding a unit to a slot points its parameters at those views.

A slot pool is a part of the engine: :class:`TorchSlots` here, ``ArenaSlots`` (``arena.py``) on the
vmm route, where the slots and the resident units live in the arena (same ``build`` / ``address`` /
``bind`` / ``close``, plus the resident placement and the per-call hooks).
"""

from __future__ import annotations

import torch

from ..units import Unit, strided_view
from .edits import set_data


class TorchSlots:
    """K slots in one PyTorch allocation on ``device``."""

    places_resident = False
    """Whether the pool places the resident units itself (the arena); else the engine does, through PyTorch."""

    def __init__(self, device: torch.device):
        self.device = device
        self.n_slots = 0
        self.slot_bytes = 0
        self.storage: torch.Tensor | None = None
        self.views: list[list[list[torch.Tensor]]] = []
        """``views[unit][slot]``: the unit's tensors in that slot, with their own shapes and strides."""

    def build(self, n_slots: int, offsets: list[list[int]], unit_nbytes: list[int],
              geometry: list[list[torch.Tensor]]) -> None:
        """Allocates ``n_slots`` slots of the largest unit and builds every view (offsets and
        geometry per streamed unit, as the unit store lays the unit out)."""
        self.n_slots = n_slots
        self.slot_bytes = max(unit_nbytes)
        self.storage = self._allocate(n_slots * self.slot_bytes)
        self.views = []
        for u in range(len(unit_nbytes)):
            per_slot = []
            for s in range(n_slots):
                base = self.storage[s * self.slot_bytes : (s + 1) * self.slot_bytes]
                per_slot.append([strided_view(base, off, g) for g, off in zip(geometry[u], offsets[u])])
            self.views.append(per_slot)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def before_place(self) -> None:
        """At the start of the attach, before any weight moves."""

    def ready(self) -> None:
        """At the end of a successful attach."""

    def call_started(self) -> None:
        pass

    def graph_blocker(self) -> str | None:
        """Why calls on these slots cannot be CUDA graphs (``None``: fixed slots, they can)."""
        return None

    def call_finished(self) -> None:
        pass

    def address(self, slot: int) -> int:
        assert self.storage is not None
        return self.storage.data_ptr() + slot * self.slot_bytes

    def bind(self, unit: Unit, u: int, slot: int) -> None:
        for (_, p), v in zip(unit.params, self.views[u][slot]):
            set_data(p, v)

    def edit_groups(self) -> list[list[tuple[str, torch.nn.Parameter]]]:
        """Resident units whose values the pool keeps a host copy of as well (none here: a resident
        parameter's device memory is its only copy, so an edit through it is seen as it is)."""
        return []

    def host_copy(self, i: int, j: int) -> torch.Tensor | None:
        """The host copy of the ``j``-th parameter of resident group ``i``, when it points elsewhere."""
        return None

    def write_back(self, i: int) -> None:
        """Copies resident group ``i``'s device values (edited there) to its host copy."""

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes

    def all_views(self) -> list[torch.Tensor]:
        return [v for unit in self.views for slot in unit for v in slot]

    def close(self) -> None:
        self.views = []
        self.storage = None
