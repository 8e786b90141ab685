"""KDA state slots: for every KDA layer, each slot holds the conv tail of the pre-conv q/k/v
inputs `[W-1, 3P]` and the recurrent state `[H, K, V]` at one token boundary.

Invariant: a slot is on the free list iff it is unowned; `allocate` hands out zeroed slots, so a
sequence that starts from an empty context reads zeros (the same as no cache). `tags[slot]` names
what a checkpoint slot holds (`checkpoint_tag.CheckpointTag`); it is None from `allocate` until
its owner tags it, and cleared on `release`. With a `journal` (`slot_journal.SlotJournal`) the
pool records each zeroing under its `name`, for other tensor-parallel ranks to replay.
"""

from __future__ import annotations

from collections import deque

import torch

from .checkpoint_tag import CheckpointTag


class OutOfSlots(RuntimeError):
    """Raised by `allocate` when no slot is free."""


class KdaStatePool:
    def __init__(
        self,
        layer_ids: list[int],
        num_slots: int,
        tail_shape: tuple[int, int],
        state_shape: tuple[int, int, int],
        tail_dtype: torch.dtype,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        name: str = "live",
    ):
        if num_slots < 1:
            raise ValueError("KdaStatePool needs at least one slot")
        self.layer_ids = list(layer_ids)
        self.num_slots = num_slots
        self._index = {lid: i for i, lid in enumerate(self.layer_ids)}
        n = len(self.layer_ids)
        self.tails = torch.zeros(n, num_slots, *tail_shape, dtype=tail_dtype, device=device)
        self.states = torch.zeros(n, num_slots, *state_shape, dtype=state_dtype, device=device)
        self._views = [(self.tails[i], self.states[i]) for i in range(n)]  # made once: a step asks per layer
        self.owned = [False] * num_slots
        self.tags: list[CheckpointTag | None] = [None] * num_slots
        self._free: deque[int] = deque(range(num_slots))
        self.name = name
        self.journal = None

    @staticmethod
    def bytes_per_slot(
        num_layers: int,
        tail_shape: tuple[int, int],
        state_shape: tuple[int, int, int],
        tail_dtype: torch.dtype,
        state_dtype: torch.dtype,
    ) -> int:
        tail = tail_shape[0] * tail_shape[1] * tail_dtype.itemsize
        state = state_shape[0] * state_shape[1] * state_shape[2] * state_dtype.itemsize
        return num_layers * (tail + state)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots("no free KDA state slot")
        slot = self._free.popleft()
        self.owned[slot] = True
        self.tags[slot] = None
        self.zero(slot)
        return slot

    def zero(self, slot: int) -> None:
        """Zero every layer's tail and state of `slot` (recorded in the journal, if any)."""
        self.tails[:, slot].zero_()
        self.states[:, slot].zero_()
        if self.journal is not None:
            self.journal.zero(self.name, slot)

    def copy_from(self, src: "KdaStatePool", s: int, d: int) -> None:
        """Copy every layer's tail and state of `src` slot `s` into slot `d` (recorded, if any)."""
        self.tails[:, d].copy_(src.tails[:, s])
        self.states[:, d].copy_(src.states[:, s])
        if self.journal is not None:
            self.journal.copy(src.name, s, self.name, d)

    def release(self, slot: int) -> None:
        if not self.owned[slot]:
            raise RuntimeError(f"release of free KDA slot {slot}")
        self.owned[slot] = False
        self.tags[slot] = None
        self._free.append(slot)

    def layer_view(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tails [S, W-1, 3P], states [S, H, K, V]) of one layer: views, not copies."""
        return self._views[self._index[layer_id]]

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies (tail [B, W-1, 3P], fp32 state [B, H, K, V]) of `slots` for one layer."""
        i = self._index[layer_id]
        return self.tails[i].index_select(0, slots), self.states[i].index_select(0, slots).float()

    def write(self, layer_id: int, slots: torch.Tensor, tail: torch.Tensor, state: torch.Tensor) -> None:
        i = self._index[layer_id]
        self.tails[i].index_copy_(0, slots, tail.to(self.tails.dtype))
        self.states[i].index_copy_(0, slots, state.to(self.states.dtype))

    def check_integrity(self, owners: dict[int, int]) -> None:
        """`owners[slot]` = number of sequences holding the slot; must be 0 or 1 and agree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("KDA free list holds a slot twice")
        for s in range(self.num_slots):
            n = owners.get(s, 0)
            if n > 1:
                raise AssertionError(f"KDA slot {s} owned by {n} sequences")
            if self.owned[s] != (n == 1) or (s in free) == self.owned[s]:
                raise AssertionError(f"KDA slot {s}: ownership disagrees with the free list")
