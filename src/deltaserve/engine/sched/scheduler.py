"""Continuous batching with chunked prefill, preemption by recompute and FIFO admission.

Each step: running sequences first, oldest first, each taking up to its pending token count
from the `max_num_batched_tokens` budget (decodes take 1, unfinished prefills take a chunk);
when pages run out the newest running sequence is preempted (cache freed, `num_computed = 0`,
put back at the head of the queue). Waiting sequences are then admitted in arrival order while
budget, `max_num_seqs` and cache allow, and never in a step that preempted; with prefix caching
an admitted sequence starts at its hit length (pages shared, state copied); a `preadmitted` one
(a received handoff) already holds its cache, starts where it ends and is admitted before the
others, whatever its place (it may hold the slot the queue's head waits for). A sequence that
cannot be admitted for lack of cache stops admission (a short request never overtakes it). The
oldest running sequence always makes progress, so no request starves.

Speculative decoding (`drafter`, engine/spec): a decoding sequence (one pending token) may get
draft tokens after it, fed in the same step and counted against the token budget; if its pages
cannot cover them it goes without (drafts never preempt anyone); with `max_step_rows` set, a
step's decode rows and drafts stay within it.

Images (`gate`): a sequence computes no position at or past the first image whose rows are not
encoded yet; the text before it may run. A running sequence so blocked is skipped (it keeps its
place and cache; others use the budget), a waiting one is admitted with no chunk, so the engine
queues its images' encode (engine/exec/encoder_cache.py), which advances every step by a bounded
amount while the other sequences step.

Prefix sharing within a step (holding, like SGLang's in-batch prefix caching): a waiting sequence
whose prompt an older running sequence is still prefilling, at least one match unit past its own
hit, is held (skipped, keeping its place) until that sequence has cached the shared span
(`CacheManager.inflight_hit`), then admitted with the hit; the shared part is computed once.
Admission continues past a held sequence, so unrelated requests use the budget it leaves.
A hold is re-decided every step and lasts only while the older sequence is running and short of
the boundary (its abort or preemption ends it), and a sequence only waits for older ones, so
holds never form a cycle. In practice a hold lasts one step: admission only runs with budget
left, so every running sequence is scheduled through its whole prefill in the step that holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ...cache.manager import CacheManager
from ..request.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    """`num_new` of the sequence's own tokens; `drafts`: speculative tokens fed after them (a
    decode step's verify, engine/spec), which no sequence holds until verified."""

    seq: Sequence
    num_new: int
    drafts: tuple[int, ...] = ()

    @property
    def width(self) -> int:
        """Tokens this step feeds for the sequence."""
        return self.num_new + len(self.drafts)

    @property
    def completes(self) -> bool:
        """After this step the whole sequence is cached, so the next token gets sampled."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # (seq, start) -> first position it may not compute yet (an image not encoded), or None
        self.gate: Callable[[Sequence, int], int | None] | None = None
        # (seq, most tokens) -> draft tokens after a decoding sequence's last one (engine/spec)
        self.drafter: Callable[[Sequence, int], list[int]] | None = None
        self.max_step_rows: int | None = None  # decode rows + drafts a step may feed (None: no cap)

    def _room(self, seq: Sequence, start: int) -> int:
        """Tokens `seq` may compute from `start` as far as its images allow."""
        stop = self.gate(seq, start) if self.gate is not None else None
        return seq.num_tokens - start if stop is None else stop - start

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its cache at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq.seq_id, finished=seq.finished and seq.finish_reason != "abort")

    def detach(self, seq: Sequence) -> None:
        """Drop a running sequence but keep its cache (a parked prefill, freed by its owner)."""
        self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.preadmitted = False
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        out: list[ScheduledSeq] = []
        budget, preempted = self._schedule_running(out)
        if not preempted:
            self._admit(out, budget)
        return out

    def _schedule_running(self, out: list[ScheduledSeq]) -> tuple[int, bool]:
        """Chunks for running sequences, oldest first, preempting the newest when pages run out;
        returns the budget left and whether anything was preempted."""
        budget = self.max_num_batched_tokens
        preempted = False
        drafted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget, self._room(seq, seq.num_computed))
            if n <= 0:  # waits for an image's encode; keeps its place and cache
                i += 1
                continue
            drafts = self._drafts(seq, n, budget, drafted)
            while not self.cache.grow(seq.seq_id, seq.num_computed + n + len(drafts)):
                if drafts:  # drafts never preempt anyone: the step goes without them
                    drafts = ()
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            out.append(ScheduledSeq(seq, n, drafts))
            budget -= n + len(drafts)
            drafted += len(drafts)
            i += 1
        return budget, preempted

    def _drafts(self, seq: Sequence, n: int, budget: int, drafted: int) -> tuple[int, ...]:
        """The drafter's tokens for a decoding sequence (its one pending token is its last), within
        the step's token budget and `max_step_rows` (each running sequence feeds a row at least,
        `drafted` drafts are planned already); () for any other."""
        room = budget - 1
        if self.max_step_rows is not None:
            room = min(room, self.max_step_rows - len(self.running) - drafted)
        if self.drafter is None or n != 1 or seq.num_pending != 1 or seq.prefill_only or room < 1:
            return ()
        return tuple(self.drafter(seq, room))

    def _admit(self, out: list[ScheduledSeq], budget: int) -> None:
        """Admit waiting sequences into `budget`: first every preadmitted one (it holds its KDA
        slot already, so a request waiting for a slot must not block it: that slot may be
        the one it holds), then the rest in order, skipping held ones, until one does not fit
        (it keeps its place and stops admission)."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if not seq.preadmitted:
                i += 1
                continue
            n = min(seq.num_pending, budget)
            if not self.cache.grow(seq.seq_id, seq.num_computed + n):
                break
            self._run(i, seq, n, out)
            budget -= n
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.preadmitted:  # left over: no budget or pages for it this step
                i += 1
                continue
            hit = None
            if self.cache.prefix_enabled:
                hit = self.cache.lookup(seq.all_ids(), seq.cache_salt, seq.prefix_hashes, seq.image_spans, restore=True)
                if self.cache.inflight_hit(hit, seq.seq_id):
                    i += 1
                    continue
            start = hit.length if hit is not None else 0
            n = max(0, min(seq.num_tokens - start, budget, self._room(seq, start)))
            if not self.cache.admit(seq.seq_id, start + n, hit, len(seq.prompt_ids)):
                break
            seq.num_computed = start
            self._run(i, seq, n, out)
            budget -= n

    def _run(self, i: int, seq: Sequence, n: int, out: list[ScheduledSeq]) -> None:
        """Move waiting `seq` to running with a chunk of `n` tokens (0: admitted, but its next
        position waits for an image's encode, so nothing is scheduled yet)."""
        del self.waiting[i]
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if n > 0:
            out.append(ScheduledSeq(seq, n))
