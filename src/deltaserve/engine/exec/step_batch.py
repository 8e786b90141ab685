"""One step as data: `step_of` turns a schedule into the `Step` message, `forward_batch` turns a
`Step` into the `ForwardBatch` over a rank's pools. Rank 0 and the workers build their batches
through the same `forward_batch`, so every rank runs the same layout."""

from __future__ import annotations

import torch

from ...cache.forward_batch import ForwardBatch
from ...cache.kda_pool import KdaStatePool
from ...cache.manager import CacheManager
from ...cache.mla_pool import MlaPagePool
from ...parallel import SINGLE, ParallelContext
from ..sched.scheduler import ScheduledSeq
from .messages import Step


def step_of(
    scheduled: list[ScheduledSeq],
    cache: CacheManager,
    logit_rows: list[int],
    ops: list = (),
    verify: list[bool] | None = None,
) -> Step:
    """The step `scheduled` makes (each sequence's tokens, then its drafts); takes the checkpoint
    slots of its interior exports from `cache` (never inside drafts: only verified tokens are
    exported). `verify`: which sequences are speculative verifies."""
    ids: list[int] = []
    offsets: list[list[int]] = []
    slots: list[int] = []
    for s in scheduled:
        ids.extend(s.seq.token_slice(s.seq.num_computed, s.seq.num_computed + s.num_new))
        ids.extend(s.drafts)
        o, sl = cache.plan_exports(s.seq.seq_id, s.seq.num_computed, s.num_new)
        offsets.append(o)
        slots.extend(sl)
    caches = [cache.seqs[s.seq.seq_id] for s in scheduled]
    return Step(
        list(ops),
        ids,
        [s.seq.num_computed for s in scheduled],
        [s.width for s in scheduled],
        [list(c.pages) for c in caches],
        [c.slot for c in caches],
        offsets if slots else None,
        slots,
        logit_rows,
        verify=verify,
    )


def forward_batch(
    step: Step,
    mla: MlaPagePool,
    kda: KdaStatePool,
    checkpoints: KdaStatePool | None,
    device: torch.device | str,
    tp: ParallelContext = SINGLE,
) -> ForwardBatch:
    """The batch of `step`, its index tensors (token ids and sampled rows included) sent to `device`
    in one copy."""
    return ForwardBatch(
        torch.tensor(step.input_ids, dtype=torch.long),
        step.context_lens,
        step.new_lens,
        step.page_tables,
        step.slots,
        mla,
        kda,
        step.export_offsets,
        step.export_slots,
        checkpoints,
        tp,
        step.logit_rows,
        device,
        step.verify,
    )


def every_row(step: Step, num_rows: int) -> bool:
    """The sampler reads every one of the step's `num_rows` rows, in order (a decode step where every
    sequence samples)."""
    rows = step.logit_rows
    return len(rows) == num_rows and rows == list(range(num_rows))


def logit_hidden(hidden: torch.Tensor, step: Step, batch: ForwardBatch) -> torch.Tensor:
    """The rows of `hidden` the sampler reads (`step.logit_rows`): `hidden` itself where they are
    every row in order (a decode step), else a gathered copy."""
    if every_row(step, hidden.shape[0]):
        return hidden
    return hidden.index_select(0, batch.logit_rows)
