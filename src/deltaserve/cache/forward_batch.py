"""`ForwardBatch`: one engine step's packed layout and its `LayerCache` view over the pools.

Sequence b of the step has `context_lens[b]` tokens already cached and `new_lens[b]` new tokens,
at rows `cu_seqlens[b]:cu_seqlens[b+1]` of the packed input. Token position t of sequence b lives
at MLA row `pages[b][t // S] * S + t % S`. All index tensors are built once per step and shared by
every layer; layers never loop over sequences.
"""

from __future__ import annotations

import torch

from ..model.context import ForwardContext
from .kda_pool import KdaStatePool
from .mla_pool import MlaPagePool


def _flat_rows(
    page_tables: list[list[int]], starts: list[int], ends: list[int], page_size: int, device
) -> torch.Tensor:
    """Flat MLA row of every position in [starts[b], ends[b]) for each b, concatenated."""
    lens = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.long)
    width = max((len(p) for p in page_tables), default=0)
    table = torch.tensor([p + [0] * (max(width, 1) - len(p)) for p in page_tables], dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(page_tables)), lens)
    first = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - first[seq] + torch.tensor(starts, dtype=torch.long)[seq]
    return (table[seq, pos // page_size] * page_size + pos % page_size).to(device)


class ForwardBatch:
    def __init__(
        self,
        input_ids: torch.Tensor,
        context_lens: list[int],
        new_lens: list[int],
        page_tables: list[list[int]],
        slots: list[int],
        mla: MlaPagePool,
        kda: KdaStatePool,
        export_offsets: list[list[int]] | None = None,
        export_slots: list[int] = (),
        checkpoints: KdaStatePool | None = None,
    ):
        """`export_offsets[b]`: interior offsets of sequence b's chunk whose KDA state the
        forward pass writes into `checkpoints` slots `export_slots` (flattened (b, offset) order)."""
        if not (len(context_lens) == len(new_lens) == len(page_tables) == len(slots)) or min(new_lens) < 1:
            raise ValueError("ForwardBatch: one entry per sequence and at least one new token each")
        device = input_ids.device
        self.input_ids = input_ids
        self.context_lens, self.new_lens = list(context_lens), list(new_lens)
        self.mla, self.kda, self.checkpoints = mla, kda, checkpoints
        n_exports = sum(len(e) for e in export_offsets) if export_offsets else 0
        if n_exports != len(export_slots) or (n_exports and checkpoints is None):
            raise ValueError("ForwardBatch: one checkpoint slot per export offset is required")
        self.export_offsets = export_offsets if n_exports else None
        self.export_slots = torch.tensor(list(export_slots), dtype=torch.long, device=device)
        self.cu_seqlens = torch.tensor([0, *new_lens], dtype=torch.long).cumsum(0).to(device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.any_context = max(context_lens) > 0
        self.decode_only = all(n == 1 for n in new_lens) and min(context_lens) > 0
        ends = [c + n for c, n in zip(context_lens, new_lens)]
        self.write_rows = _flat_rows(page_tables, context_lens, ends, mla.page_size, device)
        if self.any_context:
            self.read_rows = _flat_rows(page_tables, [0] * len(ends), ends, mla.page_size, device)
            self.cu_kv = torch.tensor([0, *ends], dtype=torch.long).cumsum(0).to(device)

    @property
    def num_seqs(self) -> int:
        return len(self.new_lens)

    def context(self) -> ForwardContext:
        return ForwardContext(self.cu_seqlens, self)

    def last_token_rows(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1

    def kda_state(self, layer: int):
        if not self.any_context:
            return None
        return self.kda.read(layer, self.slots)

    def kda_slot_view(self, layer: int):
        """(tails [S, W-1, 3P], states [S, H, K, V], slots [B]): the pool itself, for kernels that
        update this step's slots in place (decode steps only)."""
        return (*self.kda.layer_view(layer), self.slots)

    def kda_export_offsets(self):
        return self.export_offsets

    def store_kda(self, layer, conv_tail, state, exported):
        self.kda.write(layer, self.slots, conv_tail, state)
        if exported is not None:
            self.checkpoints.write(layer, self.export_slots, *exported)

    def store_mla(self, layer, latent):
        self.mla.rows(layer).index_copy_(0, self.write_rows, latent.to(self.mla.storage.dtype))

    def mla_rows_view(self, layer: int):
        """(the layer's pool rows [num_rows, R + Dr], read_rows, cu_kv): the context addressed in
        place, for kernels that read the pages directly; None without earlier context."""
        if not self.any_context:
            return None
        return self.mla.rows(layer), self.read_rows, self.cu_kv

    def mla_pool_view(self, layer: int):
        """(the layer's pool rows, write_rows, read_rows, cu_kv) for kernels that write this step's
        rows and read the context in place; None without earlier context."""
        if not self.any_context:
            return None
        return self.mla.rows(layer), self.write_rows, self.read_rows, self.cu_kv

    def mla_context(self, layer):
        if not self.any_context:
            return None
        return self.mla.rows(layer).index_select(0, self.read_rows), self.cu_kv
