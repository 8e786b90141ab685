"""`ForwardBatch`: one engine step's packed layout and its `LayerCache` view over the pools.

Sequence b of the step has `context_lens[b]` tokens already cached and `new_lens[b]` new tokens,
at rows `cu_seqlens[b]:cu_seqlens[b+1]` of the packed input. Token position t of sequence b lives
at MLA row `pages[b][t // S] * S + t % S`. All index tensors are built once per step and shared by
every layer; layers never loop over sequences.

Under decode context parallelism (`tp.dcp_world` D > 1) this rank holds only the positions t with
t % D == `tp.dcp_rank`, at local row `pages[b][t // S] * (S // D) + (t % S) // D`: it writes the
step's tokens at its positions and reads (`mla_dcp_context`) only its positions of each context,
with their global positions for the causal mask. The other MLA views are for unsharded layers and
refuse a DCP batch.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.transfer import to_device
from ..model.context import ForwardContext
from ..parallel import SINGLE, ParallelContext
from .kda_pool import KdaStatePool
from .mla_pool import MlaPagePool

_DCP_VIEW = "this ForwardBatch is context-parallel: its MLA rows are read through mla_dcp_context"


def _shared(page_tables: list[list[int]]) -> bool:
    """Whether every sequence's page list is one list (a speculative verify's chained rows)."""
    return len(page_tables) > 1 and all(p is page_tables[0] for p in page_tables)


def _page_table(page_tables: list[list[int]]) -> np.ndarray:
    """[B, max pages] int64 page ids, zero-padded (at least one column)."""
    if _shared(page_tables) and page_tables[0]:
        return np.tile(np.asarray(page_tables[0], dtype=np.int64), (len(page_tables), 1))
    table = np.zeros((len(page_tables), max((len(p) for p in page_tables), default=0) or 1), dtype=np.int64)
    for b, pages in enumerate(page_tables):
        table[b, : len(pages)] = pages
    return table


_PYTHON_ROWS = 256  # up to this many rows (decode steps) a list comprehension, past it numpy


def _flat_rows(
    pages: list[list[int]], table: np.ndarray, starts: list[int], ends: list[int], size: int
) -> torch.Tensor:
    """Flat MLA row of every position in [starts[b], ends[b]) for each b (pages `pages`, or the
    same as the zero-padded array `table`), concatenated. Few rows (a decode step's): a list
    comprehension, which touches far less code than numpy's calls (with the caches cold after a
    step's weight streaming, `ForwardBatch` of a batch-1 decode step took 260-380 µs through numpy,
    ~150 this way); many: planned in numpy."""
    if sum(ends) - sum(starts) <= _PYTHON_ROWS:
        rows = [p[t // size] * size + t % size for p, s, e in zip(pages, starts, ends) for t in range(s, e)]
        return torch.tensor(rows, dtype=torch.long)
    if _shared(pages) and not any(starts):  # nested contexts of one page list: prefixes of the longest
        pos = np.arange(max(ends), dtype=np.int64)
        base = table[0, pos // size] * size + pos % size
        return torch.from_numpy(np.concatenate([base[:e] for e in ends]))
    lens = np.subtract(ends, starts, dtype=np.int64)
    seq = np.repeat(np.arange(len(table)), lens)
    pos = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(
        np.asarray(starts, dtype=np.int64) - (lens.cumsum() - lens), lens
    )
    return torch.from_numpy(table[seq, pos // size] * size + pos % size)


def _strided_positions(starts: list[int], ends: list[int], d: int, dcp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of every position t in [starts[b], ends[b]) with t % dcp == d, by
    sequence then position."""
    firsts = [s + (d - s) % dcp for s in starts]
    lens = torch.tensor([max(0, -(-(e - f) // dcp)) for f, e in zip(firsts, ends)], dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(starts)), lens)
    first = torch.cumsum(lens, 0) - lens
    pos = (torch.arange(int(lens.sum())) - first[seq]) * dcp + torch.tensor(firsts, dtype=torch.long)[seq]
    return seq, pos


class _LazyTuple:
    """Iterates and indexes as the tuple of its `_parts()` (callables), evaluating only the
    elements asked for (the flat rows are O(context) to build)."""

    def _parts(self) -> tuple:
        raise NotImplementedError

    def __iter__(self):
        return (part() for part in self._parts())

    def __getitem__(self, i: int):
        return self._parts()[i]()


@dataclass(frozen=True)
class MlaRowsView(_LazyTuple):
    """A layer's context in place: pool `rows` [num_rows, R + Dr]; sequence b's positions are rows
    `block_table[b, t // page_size] * page_size + t % page_size` for t < cu_kv[b+1] - cu_kv[b].
    Unpacks and indexes as (rows, read_rows, cu_kv), `read_rows` planned on first use."""

    rows: torch.Tensor
    cu_kv: torch.Tensor
    block_table: torch.Tensor
    page_size: int
    batch: "ForwardBatch"

    def _parts(self) -> tuple:
        return (lambda: self.rows, lambda: self.batch.read_rows, lambda: self.cu_kv)


@dataclass(frozen=True)
class MlaPoolView(_LazyTuple):
    """`MlaRowsView`'s context plus the rows this step writes: unpacks and indexes as (rows,
    write_rows, read_rows, cu_kv), `read_rows` planned on first use."""

    rows: torch.Tensor
    write_rows: torch.Tensor
    cu_kv: torch.Tensor
    batch: "ForwardBatch"

    def _parts(self) -> tuple:
        return (lambda: self.rows, lambda: self.write_rows, lambda: self.batch.read_rows, lambda: self.cu_kv)


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
        tp: ParallelContext = SINGLE,
        logit_rows: list[int] = (),
        device: torch.device | str | None = None,
        verify: list[bool] | None = None,
    ):
        """`export_offsets[b]`: interior offsets of sequence b's chunk whose KDA state the
        forward pass writes into `checkpoints` slots `export_slots` (flattened (b, offset) order).
        `tp`: the rank's context; with `tp.dcp_world` > 1, `mla` must be built with that dcp_world.
        `logit_rows`: the packed rows the sampler reads (`self.logit_rows`). Every index tensor,
        and host `input_ids`, goes to `device` (default: input_ids') in one `to_device` copy.
        `verify[b]`: sequence b is a speculative verify (its token and drafts): the forward pass
        never writes its live KDA slot, which keeps the pre-verify state until `fold_inputs` /
        `fold_store` fold its verified tokens (`set_verified`); no in-place decode path runs."""
        if not (len(context_lens) == len(new_lens) == len(page_tables) == len(slots)) or min(new_lens) < 1:
            raise ValueError("ForwardBatch: one entry per sequence and at least one new token each")
        device = input_ids.device if device is None else torch.device(device)
        self.context_lens, self.new_lens = list(context_lens), list(new_lens)
        self.mla, self.kda, self.checkpoints = mla, kda, checkpoints
        n_exports = sum(len(e) for e in export_offsets) if export_offsets else 0
        if n_exports != len(export_slots) or (n_exports and checkpoints is None):
            raise ValueError("ForwardBatch: one checkpoint slot per export offset is required")
        if mla.dcp_world != tp.dcp_world:
            raise ValueError(f"ForwardBatch: MLA pool built for dcp_world {mla.dcp_world}, rank has {tp.dcp_world}")
        self.export_offsets = export_offsets if n_exports else None
        self.any_context = max(context_lens) > 0
        self.verify = [b for b, v in enumerate(verify or ()) if v]
        self.decode_only = all(n == 1 for n in new_lens) and min(context_lens) > 0 and not self.verify
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.kda_record = None  # a chained verify's `KdaRecord` the decode kernels fill (ops/kda_record.py)
        ends = [c + n for c, n in zip(context_lens, new_lens)]
        self.dcp = tp if tp.dcp_world > 1 else None
        host = {
            "export_slots": torch.tensor(list(export_slots), dtype=torch.long),
            "cu_seqlens": torch.tensor([0, *new_lens], dtype=torch.long).cumsum(0),
            "slots": torch.tensor(slots, dtype=torch.long),
            "logit_rows": torch.tensor(list(logit_rows), dtype=torch.long),
        }
        if self.verify:
            others = [b for b in range(len(slots)) if b not in set(self.verify)]
            host["verify_slots"] = torch.tensor([slots[b] for b in self.verify], dtype=torch.long)
            host["written"] = torch.tensor(others, dtype=torch.long)
            host["written_slots"] = torch.tensor([slots[b] for b in others], dtype=torch.long)
        if self.dcp is not None:
            host.update(self._dcp_rows(page_tables, ends))
        else:
            table = _page_table(page_tables)
            host["write_rows"] = _flat_rows(page_tables, table, context_lens, ends, mla.page_size)
            if self.any_context:
                host["block_table"] = torch.from_numpy(table)
                host["cu_kv"] = torch.tensor([0, *ends], dtype=torch.long).cumsum(0)
                self._context = (page_tables, table, ends, device)
        if input_ids.is_cpu:
            host["input_ids"] = input_ids.long()
        else:
            self.input_ids = input_ids
        self.write_src = None
        for name, t in to_device(host, device).items():
            setattr(self, name, t)

    def _dcp_rows(self, page_tables: list[list[int]], ends: list[int]) -> dict[str, torch.Tensor]:
        """This DCP rank's write rows (and which step tokens they take), read rows, the global
        position of each read row (`kv_pos`) and of each step token (`q_pos`), and local `cu_kv`."""
        dcp, d = self.dcp.dcp_world, self.dcp.dcp_rank
        table, size, local = torch.from_numpy(_page_table(page_tables)), self.mla.page_size, self.mla.rows_per_page
        starts = torch.tensor(self.context_lens, dtype=torch.long)
        cu = torch.tensor([0, *self.new_lens], dtype=torch.long).cumsum(0)
        seq, pos = _strided_positions(self.context_lens, ends, d, dcp)
        out = {
            "write_rows": table[seq, pos // size] * local + pos % size // dcp,
            "write_src": cu[seq] + pos - starts[seq],
        }
        seq, pos = _strided_positions([0] * len(ends), ends, d, dcp)
        out["read_rows"] = table[seq, pos // size] * local + pos % size // dcp
        out["kv_pos"] = pos
        out["cu_kv"] = torch.cat([cu.new_zeros(1), torch.bincount(seq, minlength=len(ends)).cumsum(0)])
        out["q_pos"] = _strided_positions(self.context_lens, ends, 0, 1)[1]
        return out

    @functools.cached_property
    def read_rows(self) -> torch.Tensor:
        """Flat pool row of every context position, by sequence (O(context) to plan and send:
        built on first use; kernels that take `block_table` never ask)."""
        pages, table, ends, device = self._context
        return to_device({"r": _flat_rows(pages, table, [0] * len(ends), ends, self.mla.page_size)}, device)["r"]

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
        if not self.verify:
            self.kda.write(layer, self.slots, conv_tail, state)
        elif self.written.numel():
            w = self.written
            self.kda.write(layer, self.written_slots, conv_tail.index_select(0, w), state.index_select(0, w))
        if exported is not None:
            self.checkpoints.write(layer, self.export_slots, *exported)

    def keep_kda_inputs(self, layer: int, pre: torch.Tensor, f: torch.Tensor, beta: torch.Tensor) -> None:
        """A KDA layer's per-token recurrence inputs of the step, kept (references, no copy) until the
        fold when the step verifies drafts: O(tokens) rows, never a state per draft."""
        if self.verify:
            self._kept[layer] = (pre, f, beta)

    def set_verified(self, counts: list[int]) -> None:
        """`counts[i]` (>= 1): how many leading tokens of the i-th verify sequence are verified;
        only those are folded into its live state."""
        if len(counts) != len(self.verify) or min(counts, default=1) < 1:
            raise ValueError("one verified count (>= 1) per verify sequence")
        starts = [0, *itertools.accumulate(self.new_lens)]
        rows = [r for b, c in zip(self.verify, counts) for r in range(starts[b], starts[b] + c)]
        host = {"rows": torch.tensor(rows, dtype=torch.long), "cu": torch.tensor([0, *counts]).cumsum(0)}
        self._fold = to_device(host, self.slots.device)

    def fold_inputs(self, layer: int):
        """(pre, f, beta) of the verified tokens, their cu_seqlens and the verify sequences'
        pre-verify (tails, states): what `KdaAttention.replay` folds."""
        rows = self._fold["rows"]
        pre, f, beta = (t.index_select(0, rows) for t in self._kept.pop(layer))
        return pre, f, beta, self._fold["cu"], self.kda.read(layer, self.verify_slots)

    def fold_store(self, layer: int, tail: torch.Tensor, state: torch.Tensor) -> None:
        self.kda.write(layer, self.verify_slots, tail, state)

    def store_mla(self, layer, latent):
        if self.write_src is not None:
            latent = latent.index_select(0, self.write_src)
        self.mla.rows(layer).index_copy_(0, self.write_rows, latent.to(self.mla.storage.dtype))

    def mla_rows_view(self, layer: int):
        """`MlaRowsView` of the layer: (pool rows [num_rows, R + Dr], read_rows, cu_kv) as a tuple,
        and the page table for kernels that take pages; None without earlier context."""
        if self.dcp is not None:
            raise RuntimeError(_DCP_VIEW)
        if not self.any_context:
            return None
        return MlaRowsView(self.mla.rows(layer), self.cu_kv, self.block_table, self.mla.page_size, self)

    def mla_pool_view(self, layer: int):
        """`MlaPoolView` of the layer, (pool rows, write_rows, read_rows, cu_kv), for kernels that
        write this step's rows and read the context in place; None without earlier context."""
        if self.dcp is not None:
            raise RuntimeError(_DCP_VIEW)
        if not self.any_context:
            return None
        return MlaPoolView(self.mla.rows(layer), self.write_rows, self.cu_kv, self)

    def mla_context(self, layer):
        if self.dcp is not None:
            raise RuntimeError(_DCP_VIEW)
        if not self.any_context:
            return None
        return self.mla.rows(layer).index_select(0, self.read_rows), self.cu_kv

    def mla_dcp_context(self, layer: int):
        """(local rows [Nkv, R + Dr], their global positions kv_pos [Nkv], local cu_kv [B+1], global
        position q_pos [N] of each step token): this rank's positions of every sequence's context
        including the step's own rows (store them first). DCP batches only."""
        if self.dcp is None:
            raise RuntimeError("mla_dcp_context needs a context-parallel ForwardBatch (tp.dcp_world > 1)")
        return self.mla.rows(layer).index_select(0, self.read_rows), self.kv_pos, self.cu_kv, self.q_pos

    def mla_dcp_rows_view(self, layer: int):
        """(pool rows, read_rows, local cu_kv): the rows `mla_dcp_context` gathers, read in place by a
        decode kernel (a sequence may have none here). DCP batches only."""
        if self.dcp is None:
            raise RuntimeError("mla_dcp_rows_view needs a context-parallel ForwardBatch (tp.dcp_world > 1)")
        return self.mla.rows(layer), self.read_rows, self.cu_kv
