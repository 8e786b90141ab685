"""`ModelRunner`: turns a schedule into one packed forward pass over the paged cache and samples
the sequences whose cached prefix became complete in this step."""

from __future__ import annotations

import torch

from ..cache.forward_batch import ForwardBatch
from ..cache.manager import CacheManager
from ..model.kimi import KimiForCausalLM
from .sampler import Sampler, SamplerOutput, SamplingRow
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, cache: CacheManager, sampler: Sampler | None = None):
        self.model, self.cache = model, cache
        self.sampler = sampler or Sampler()

    def build_batch(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        ids: list[int] = []
        for s in scheduled:
            ids.extend(s.seq.token_slice(s.seq.num_computed, s.seq.num_computed + s.num_new))
        caches = [self.cache.seqs[s.seq.seq_id] for s in scheduled]
        offsets, slots = [], []
        for s in scheduled:
            o, sl = self.cache.plan_exports(s.seq.seq_id, s.seq.num_computed, s.num_new)
            offsets.append(o)
            slots.extend(sl)
        return ForwardBatch(
            torch.tensor(ids, dtype=torch.long, device=self.model.device),
            [s.seq.num_computed for s in scheduled],
            [s.num_new for s in scheduled],
            [c.pages for c in caches],
            [c.slot for c in caches],
            self.cache.mla,
            self.cache.kda,
            offsets if slots else None,
            slots,
            self.cache.ckpt_pool,
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], rows: list[SamplingRow | None]) -> SamplerOutput | None:
        """Run the step; `rows[i]` is the sampling state of `scheduled[i]` if it completes, else
        None. Returns the sampler's output for the completing sequences, in order."""
        batch = self.build_batch(scheduled)
        hidden = self.model(batch.input_ids, batch.context())
        pick = [i for i, r in enumerate(rows) if r is not None]
        if not pick:
            return None
        last = batch.last_token_rows()[torch.tensor(pick, dtype=torch.long, device=hidden.device)]
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return self.sampler(logits, [rows[i] for i in pick])
