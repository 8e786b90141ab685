"""A speculative verify step as decode rows: on a backend whose decode kernel chains rows that share
a KDA slot (`ops.chains_decode_rows`: the native CPU kernels, bf16 model and pools), a sequence's
token and its k drafts run as k + 1 adjacent one-token rows of one decode step, on its pages and
its live slot, with contexts c, c + 1, ..., c + k. The step is then the backend's whole decode
call (one native call, the same roundings as k + 1 decode steps: greedy output stays the target's
own bit for bit), not the module-by-module prefill path plus a fold.

Rollback: before the call each drafted sequence's live KDA slot (every layer's tail and state)
is copied aside: one state per request, O(1) in k. During the call the decode kernels record what
each KDA layer's recurrence reads of every row (`KdaRecord`, ops/kda_record.py: q, k, v before the
conv, the gate input f and the beta logit, 4P + H bf16 values a row and KDA layer: O(k) rows a
request). The call leaves the slot past all k + 1 tokens; `fold` keeps that where every fed token
was verified, else puts the copy back and replays the verified rows' KDA updates alone (conv tail
shift and delta-rule update, every KDA layer in one native call through the decode kernel's own
arithmetic: the tails and states plain decode steps of those tokens leave, bit for bit); no
projection, MoE or MLA runs again. Where some layer went unrecorded (it ran off the native
kernels) the fold runs the verified rows again as one decode call instead (they rewrite the same
MLA rows with the same values). Rows past the verified tokens are never read (contexts end at
`num_computed`)."""

from __future__ import annotations

import itertools

import torch

from ...cache.manager import CacheManager
from ...model.kimi import KimiForCausalLM
from ...ops.kda_record import KdaRecord
from .messages import Step
from .step_batch import every_row, forward_batch


def chains(model: KimiForCausalLM, cache: CacheManager) -> bool:
    """Whether the model's decode chains rows sharing a slot: the backend says so and the step
    runs on its native kernels (bf16 activations, bf16 tails, fp32 states)."""
    kda = cache.kda
    return (
        getattr(getattr(model, "ops", None), "chains_decode_rows", False)
        and model.dtype == torch.bfloat16
        and kda.tails.dtype == torch.bfloat16
        and kda.states.dtype == torch.float32
    )


def rows_of(step: Step, keep: list[int] | None = None) -> Step | None:
    """`step` as a decode step of one-token rows (the first `keep[b]` tokens of sequence b, all
    where None), or None where it cannot be one: a sequence without context, checkpoint exports,
    image rows."""
    if step.export_slots or step.embeds is not None or min(step.context_lens, default=0) < 1:
        return None
    keep = keep if keep is not None else step.new_lens
    ids, ctx, pages, slots, at = [], [], [], [], 0
    for c, n, p, s, m in zip(step.context_lens, step.new_lens, step.page_tables, step.slots, keep):
        ids.extend(step.input_ids[at : at + m])
        ctx.extend(range(c, c + m))
        pages.extend([p] * m)
        slots.extend([s] * m)
        at += n
    return Step([], ids, ctx, [1] * len(ids), pages, slots, None, [], list(range(len(ids))))


class ChainedVerify:
    """One chained verify step between `logits` and `fold` (the batch `SpecDecoder` holds)."""

    def __init__(self, step: Step, rows: Step, verify: list[bool], cache: CacheManager):
        """Saves the live slots of the verify sequences with drafts (one without has nothing to
        undo: its one fed token is verified)."""
        self.step, self.rows, self.cache = step, rows, cache
        self.verify = [b for b, v in enumerate(verify) if v]
        self.drafted = [b for b in self.verify if step.new_lens[b] > 1]
        kda = cache.kda
        self.live = torch.tensor([step.slots[b] for b in self.drafted], dtype=torch.long, device=kda.states.device)
        self.saved = (kda.tails.index_select(1, self.live), kda.states.index_select(1, self.live))
        self.record = KdaRecord(len(rows.input_ids)) if self.drafted else None

    def logits(self, model: KimiForCausalLM) -> torch.Tensor:
        """fp32 logits of the step's `logit_rows` (the packed rows are the decode rows, in order)."""
        c = self.cache
        batch = forward_batch(self.rows, c.mla, c.kda, c.ckpt_pool, model.device)
        batch.kda_record = self.record
        logits = model.decode_logits(batch.input_ids, batch.context())
        if every_row(self.step, logits.shape[0]):
            return logits
        return logits.index_select(0, torch.tensor(self.step.logit_rows, dtype=torch.long, device=logits.device))

    def fold(self, model: KimiForCausalLM, verified: list[int]) -> None:
        """Leave each verify sequence's live slot after its `verified` leading fed tokens."""
        if len(verified) != len(self.verify):
            raise ValueError("one verified count per verify sequence")
        count = dict(zip(self.verify, verified))
        short = [i for i, b in enumerate(self.drafted) if count[b] < self.step.new_lens[b]]
        if not short:
            return
        kda = self.cache.kda
        idx = torch.tensor(short, dtype=torch.long, device=self.live.device)
        live = self.live.index_select(0, idx)
        kda.tails.index_copy_(1, live, self.saved[0].index_select(1, idx))
        kda.states.index_copy_(1, live, self.saved[1].index_select(1, idx))
        if self._replay(model, [self.drafted[i] for i in short], count):
            return
        keep = [0] * len(self.step.new_lens)
        for i in short:
            keep[self.drafted[i]] = count[self.drafted[i]]
        again = rows_of(self.step, keep)
        if again is not None and again.input_ids:
            c = self.cache
            batch = forward_batch(again, c.mla, c.kda, c.ckpt_pool, model.device)
            model(batch.input_ids, batch.context())

    def _replay(self, model: KimiForCausalLM, seqs: list[int], count: dict[int, int]) -> bool:
        """Replay the recorded KDA updates of `seqs`' first `count[b]` rows onto their restored
        slots; False (nothing done) where the step's record does not cover every KDA layer."""
        starts = [0, *itertools.accumulate(self.step.new_lens)]
        rows = [r for b in seqs for r in range(starts[b], starts[b] + count[b])]
        slots = [self.step.slots[b] for b in seqs for _ in range(count[b])]
        kda = self.cache.kda
        views = {layer: kda.layer_view(layer) for layer in model.config.kda_layer_ids}
        return model.ops.replay_kda(self.record, views, rows, slots)
