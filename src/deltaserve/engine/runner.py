"""`ModelRunner`: turns a schedule into one packed forward pass over the paged cache and samples
the sequences whose cached prefix became complete in this step.

Under tensor parallelism (`attach`) the step is first broadcast to the other ranks as a `Step`
message carrying the slot writes the cache manager journaled since the last one; every rank
then runs the same forward pass (and, for the vocab-parallel lm_head, the same logits rows).
Any failure there is fatal: the group is marked failed and `RankFailure` raised.
"""

from __future__ import annotations

import itertools

import msgspec
import torch

from ..cache.manager import CacheManager
from ..cache.slot_journal import SlotJournal
from ..model.kimi import KimiForCausalLM
from ..parallel import SINGLE
from .channel import ControlChannel
from .messages import Snapshot
from .pool_snapshot import pool_snapshot
from .ranks import RankFailure, RankGroup
from .sampler import Sampler, SamplerOutput, SamplingRow
from .scheduler import ScheduledSeq
from .step_batch import forward_batch, step_of


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, cache: CacheManager, sampler: Sampler | None = None):
        self.model, self.cache = model, cache
        self.sampler = sampler or Sampler()
        self.tp = getattr(model, "tp", SINGLE)
        self.channel: ControlChannel | None = None
        self.journal: SlotJournal | None = None
        self.ranks: RankGroup | None = None

    def attach(self, channel: ControlChannel, journal: SlotJournal, ranks: RankGroup | None) -> None:
        """Drive the other ranks: send each step on `channel` with `journal`'s slot writes."""
        self.channel, self.journal, self.ranks = channel, journal, ranks

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], rows: list[SamplingRow | None]) -> SamplerOutput | None:
        """Run the step; `rows[i]` is the sampling state of `scheduled[i]` if it completes, else
        None. Returns the sampler's output for the completing sequences, in order."""
        ends = list(itertools.accumulate(s.num_new for s in scheduled))
        pick = [i for i, r in enumerate(rows) if r is not None]
        step = step_of(scheduled, self.cache, [ends[i] - 1 for i in pick])
        if self.channel is None:
            return self._run(step, rows, pick)
        # taken after step_of: its checkpoint slots' zeroing must replay before this forward pass
        step = msgspec.structs.replace(step, ops=self.journal.take())
        try:
            self.channel.send(step)
            return self._run(step, rows, pick)
        except Exception as e:
            message = f"a tensor-parallel step failed: {type(e).__name__}: {e}"
            if self.ranks is not None:
                self.ranks.fail(message)
            raise RankFailure(message) from e

    def pool_snapshot(self) -> dict[str, torch.Tensor]:
        """Every rank's pools in the one-process layout (`pool_snapshot`), between steps."""
        if self.channel is not None:
            self.channel.send(Snapshot())
        return pool_snapshot(self.tp, self.cache.mla, self.cache.kda, self.cache.ckpt_pool)

    def _run(self, step, rows: list[SamplingRow | None], pick: list[int]) -> SamplerOutput | None:
        batch = forward_batch(step, self.cache.mla, self.cache.kda, self.cache.ckpt_pool, self.model.device, self.tp)
        hidden = self.model(batch.input_ids, batch.context())
        if not pick:
            return None
        last = torch.tensor(step.logit_rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return self.sampler(logits, [rows[i] for i in pick])
