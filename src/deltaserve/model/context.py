"""What a layer sees besides its input: the packed-batch layout and, optionally, a cache.

`ForwardContext.cache is None` means every sequence starts empty and nothing is kept
(`forward_full`, the no-cache reference). Otherwise the cache implements `LayerCache`; the
engine's paged pools implement it in `deltaserve.cache`, and `DenseCache` below is the
simplest faithful implementation (contiguous per-sequence storage), used by tests and as the
behavioural model for the paged one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class LayerCache(Protocol):
    """Per-step cache view. Sequence b of the step owns rows cu_seqlens[b]:cu_seqlens[b+1].

    Two optional methods let native decode kernels work on the pools in place; layers probe
    for them with getattr and otherwise use the methods below (`DenseCache` has neither):
    `kda_slot_view(layer)` -> (tails [S, W-1, 3P], states [S, H, K, V], slots [B]) and
    `mla_rows_view(layer)` -> (pool rows [num_rows, R + Dr], read_rows [Nkv], cu_kv [B+1]) or
    None without earlier context (the engine's view also has `block_table` and `page_size`).

    A cache for a decode-context-parallel rank (`ParallelContext.dcp_world` D > 1) keeps only the
    positions t with t % D == its DCP rank: `store_mla` still receives all N rows and keeps its own,
    the unsharded MLA views above are unavailable, and `mla_dcp_context` (below) is the one read
    (`DenseCache` has none; `DcpMlaAttention` needs it); optionally `mla_dcp_rows_view(layer)` ->
    (pool rows, read_rows, local cu_kv): the same rows in place, for a decode kernel."""

    decode_only: bool  # every sequence has one new token and an existing state

    def kda_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(conv_tail [B, W-1, 3P], state fp32 [B, H, K, V]) entering this step, or None when
        every sequence starts from zeros. The layer may update both tensors in place."""

    def kda_export_offsets(self) -> list[list[int]] | None:
        """Per sequence, offsets (relative to the step's first token) whose state to export."""

    def store_kda(
        self,
        layer: int,
        conv_tail: torch.Tensor,
        state: torch.Tensor,
        exported: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Receive the states after the step and, if offsets were requested, the exported
        (conv tails [E, W-1, 3P], fp32 states [E, H, K, V]) in (sequence, offset) order."""

    def store_mla(self, layer: int, latent: torch.Tensor) -> None:
        """Append the step's latent rows [N, R + Dr] (normalised c_hat | k_rot)."""

    def mla_context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [Nkv, R + Dr], cu_kv [B+1]) of each sequence's whole context including this
        step's rows, or None when no sequence has rows before this step."""

    def mla_dcp_context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """DCP caches only: (rows [Nkv, R + Dr], kv_pos int64 [Nkv], cu_kv [B+1], q_pos int64 [N]):
        this rank's rows of each sequence's context including this step's (after `store_mla`),
        packed by cu_kv in position order, the global position of each row, and the global
        position of each of the step's N tokens (query i sees the rows with kv_pos <= q_pos[i])."""


@dataclass
class ForwardContext:
    cu_seqlens: torch.Tensor  # int64 [B+1]
    cache: LayerCache | None = None

    @classmethod
    def single(cls, num_tokens: int, device: torch.device | str = "cpu") -> "ForwardContext":
        return cls(torch.tensor([0, num_tokens], dtype=torch.long, device=device))

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1


class DenseCache:
    """Contiguous cache for a fixed set of sequences; call `begin(new_lens)` before each step."""

    def __init__(self, num_seqs: int):
        self.num_seqs = num_seqs
        self.lengths = [0] * num_seqs
        self.kda: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.mla: dict[int, list[torch.Tensor]] = {}
        self.exports: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.export_offsets: list[list[int]] | None = None
        self.decode_only = False
        self._new: list[int] = [0] * num_seqs

    def begin(self, new_lens: list[int], export_offsets: list[list[int]] | None = None) -> ForwardContext:
        if len(new_lens) != self.num_seqs or min(new_lens) < 1:
            raise ValueError("one positive new-token count per sequence is required")
        self._new = list(new_lens)
        self.decode_only = all(n == 1 for n in new_lens) and min(self.lengths) > 0
        self.export_offsets = export_offsets
        cu = torch.tensor([0, *new_lens], dtype=torch.long).cumsum(0)
        return ForwardContext(cu, self)

    def end(self) -> None:
        self.lengths = [a + b for a, b in zip(self.lengths, self._new)]

    def kda_state(self, layer):
        return self.kda.get(layer)

    def kda_export_offsets(self):
        return self.export_offsets

    def store_kda(self, layer, conv_tail, state, exported):
        self.kda[layer] = (conv_tail, state)
        if exported is not None:
            self.exports[layer] = exported

    def store_mla(self, layer, latent):
        rows = self.mla.setdefault(layer, [latent.new_zeros(0, latent.shape[-1])] * self.num_seqs)
        splits = latent.split(self._new)
        self.mla[layer] = [torch.cat([old, new]) for old, new in zip(rows, splits)]

    def mla_context(self, layer):
        if max(self.lengths) == 0:
            return None
        rows = self.mla[layer]
        cu = torch.tensor([0, *[r.shape[0] for r in rows]], dtype=torch.long).cumsum(0)
        return torch.cat(rows), cu
