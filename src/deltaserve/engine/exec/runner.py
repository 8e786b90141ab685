"""`ModelRunner`: turns a schedule into one packed forward pass over the paged cache and samples
the sequences whose cached prefix became complete in this step.

Under tensor parallelism (`attach`) the step is first broadcast to the other ranks as a `Step`
message carrying the slot writes the cache manager journaled since the last one; every rank
then runs the same forward pass (and, for the vocab-parallel lm_head, the same logits rows).
Any failure there is fatal: the group is marked failed and `RankFailure` raised.

With a vision model (`encoder`), a step whose chunks cover `<|media_pad|>` positions gets those
images' projector rows from the encoder cache (misses encoded in one packed call, on rank 0 only)
and injects the rows of exactly the covered positions; other ranks receive them in the `Step`.

With `keep_hidden` (a speculative proposer that taps the target, engine/spec/proposer.py) every
step keeps `hidden`: the final-normed hidden rows the sampler's logits came from, in logit-row
order (the fused decode call, which never materialises them, is then not used).
"""

from __future__ import annotations

import itertools

import msgspec
import torch

from ...cache.forward_batch import ForwardBatch
from ...cache.manager import CacheManager
from ...cache.slot_journal import SlotJournal
from ...model.experts import expert_load
from ...model.kimi import KimiForCausalLM
from ...parallel import SINGLE
from ..request.mm_inputs import chunk_rows, gather_rows
from ..sched.scheduler import ScheduledSeq
from .chained_verify import ChainedVerify, chains, rows_of
from .channel import ControlChannel
from .encoder_cache import EncoderCache
from .messages import EmbedRows, ExpertLoad, Fold, Idle, Snapshot, TensorBytes
from .pool_snapshot import pool_snapshot
from .ranks import RankFailure, RankGroup
from .sampler import Sampler, SamplerOutput, SamplingRow
from .step_batch import every_row, forward_batch, logit_hidden, step_of


class ModelRunner:
    def __init__(self, model: KimiForCausalLM, cache: CacheManager, sampler: Sampler | None = None):
        self.model, self.cache = model, cache
        self.sampler = sampler or Sampler()
        self.tp = getattr(model, "tp", SINGLE)
        self.channel: ControlChannel | None = None
        self.journal: SlotJournal | None = None
        self.ranks: RankGroup | None = None
        self.encoder: EncoderCache | None = None
        self.transfer = None  # this rank's KV transfer engine (`rank_transfer`), once a role starts it
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None  # the latest step's logit rows' hidden states (`keep_hidden`)

    def attach(self, channel: ControlChannel, journal: SlotJournal, ranks: RankGroup | None) -> None:
        """Drive the other ranks: send each step on `channel` with `journal`'s slot writes."""
        self.channel, self.journal, self.ranks = channel, journal, ranks

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], rows: list[SamplingRow | None]) -> SamplerOutput | None:
        """Run the step; `rows[i]` is the sampling state of `scheduled[i]` if it completes, else
        None. Returns the sampler's output for the completing sequences, in order."""
        ends = list(itertools.accumulate(s.width for s in scheduled))
        pick = [i for i, r in enumerate(rows) if r is not None]
        step = step_of(scheduled, self.cache, [ends[i] - 1 for i in pick])
        embeds = self._image_rows(scheduled, ends)
        if self.channel is None:
            return self._run(step, rows, pick, embeds)
        # taken after step_of: its checkpoint slots' zeroing must replay before this forward pass
        sent = None if embeds is None else EmbedRows(embeds[0].tolist(), TensorBytes.of(embeds[1]))
        step = msgspec.structs.replace(step, ops=self.journal.take(), embeds=sent)
        return self._on_ranks(step, lambda: self._run(step, rows, pick, embeds))

    @torch.inference_mode()
    def verify_logits(
        self, scheduled: list[ScheduledSeq], logit_rows: list[int], verify: list[bool]
    ) -> tuple[torch.Tensor, ForwardBatch | ChainedVerify]:
        """A speculative verify step (engine/spec): fp32 logits of the packed `logit_rows` and the
        step's batch, whose verify sequences' live KDA states still hold the pre-verify state until
        `fold` (on every rank: the other ranks keep their batch for the `Fold` that follows). On
        one process with a backend that chains decode rows, the step runs as decode rows instead
        (`ChainedVerify`: the live slots are past every fed token until `fold`)."""
        step = step_of(scheduled, self.cache, logit_rows, verify=verify)
        native = self.channel is None and not self.keep_hidden and chains(self.model, self.cache)
        rows = rows_of(step) if native else None
        if rows is not None:  # one native decode call over the drafted rows (chained_verify.py)
            chained = ChainedVerify(step, rows, verify, self.cache)
            self.hidden = None
            return chained.logits(self.model), chained

        def run():
            batch = forward_batch(
                step, self.cache.mla, self.cache.kda, self.cache.ckpt_pool, self.model.device, self.tp
            )
            hidden = logit_hidden(self.model(batch.input_ids, batch.context()), step, batch)
            self.hidden = hidden if self.keep_hidden else None
            return self.model.compute_logits(hidden), batch

        if self.channel is None:
            return run()
        step = msgspec.structs.replace(step, ops=self.journal.take())
        return self._on_ranks(step, run)

    @torch.inference_mode()
    def fold(self, batch: ForwardBatch | ChainedVerify, verified: list[int]) -> None:
        """Fold each verify sequence's `verified` leading tokens into its live KDA state (every rank)."""
        if isinstance(batch, ChainedVerify):
            return batch.fold(self.model, verified)

        def run():
            batch.set_verified(verified)
            self.model.fold_kda(batch)

        return run() if self.channel is None else self._on_ranks(Fold(verified), run)

    def _on_ranks(self, message, run):
        """Send `message` to the other ranks, then `run()` here; any failure fails the group."""
        try:
            self.channel.send(message)
            return run()
        except Exception as e:
            text = f"a tensor-parallel step failed: {type(e).__name__}: {e}"
            if self.ranks is not None:
                self.ranks.fail(text)
            raise RankFailure(text) from e

    def _image_rows(self, scheduled: list[ScheduledSeq], ends: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed positions, projector rows) of the image pad positions this step covers."""
        if self.encoder is None:
            return None
        needed = [
            c
            for s, end in zip(scheduled, ends)
            if s.seq.images
            for c in chunk_rows(
                s.seq.images, s.seq.image_starts, s.seq.num_computed, s.seq.num_computed + s.num_new, end - s.width
            )
        ]
        if not needed:
            return None
        return gather_rows(needed, self.encoder.rows(c.image for c in needed))

    def idle_forward(self) -> None:
        """Wide EP: this replica's zero-token forward on every one of its ranks (`Idle`)."""
        if self.channel is None:
            return self.model.idle_forward()
        self._on_ranks(Idle(), self.model.idle_forward)

    def expert_load(self) -> dict | None:
        """Wide EP: the tokens each routed expert of this replica ran (`model.experts.expert_load`),
        its ranks' experts in rank order (contiguous: replica i's TP ranks hold experts
        [i T L, (i + 1) T L)); None where no exchange ran."""
        mine = expert_load(self.model)
        if self.channel is None or self.tp.ep_world == 1:
            return mine
        parts = self._on_ranks(ExpertLoad(), lambda: self.channel.gather(msgspec.msgpack.encode(mine)))
        loads = [msgspec.msgpack.decode(p) for p in parts]
        if any(load is None for load in loads):
            return None
        return {"first": loads[0]["first"], "tokens": [n for load in loads for n in load["tokens"]]}

    def pool_snapshot(self) -> dict[str, torch.Tensor]:
        """Every rank's pools in the one-process layout (`pool_snapshot`), between steps."""
        if self.channel is not None:
            self.channel.send(Snapshot())
        return pool_snapshot(self.tp, self.cache.mla, self.cache.kda, self.cache.ckpt_pool)

    def _run(self, step, rows: list[SamplingRow | None], pick: list[int], embeds=None) -> SamplerOutput | None:
        batch = forward_batch(step, self.cache.mla, self.cache.kda, self.cache.ckpt_pool, self.model.device, self.tp)
        ctx = batch.context()
        self.hidden = None
        if embeds is None and pick and every_row(step, batch.input_ids.shape[0]) and not self.keep_hidden:
            return self.sample(self.model.decode_logits(batch.input_ids, ctx), [rows[i] for i in pick])
        hidden = self.model(batch.input_ids, ctx) if embeds is None else self.model(batch.input_ids, ctx, embeds)
        if not pick:
            return None
        hidden = logit_hidden(hidden, step, batch)
        self.hidden = hidden if self.keep_hidden else None
        logits = self.model.compute_logits(hidden)
        return self.sample(logits, [rows[i] for i in pick])

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """The sampler, its greedy choice on the model's bound backend (`model.ops`, as it is now)."""
        ops = getattr(self.model, "ops", None)
        return self.sampler(logits, rows, None if ops is None else ops.argmax_rows)
