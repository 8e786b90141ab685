"""Continuous batching with chunked prefill, preemption by recompute and FIFO admission.

Each step: running sequences first, oldest first, each taking up to its pending token count
from the `max_num_batched_tokens` budget (decodes take 1, unfinished prefills take a chunk);
when pages run out the newest running sequence is preempted (cache freed, `num_computed = 0`,
put back at the head of the queue). Waiting sequences are then admitted strictly in arrival
order while budget, `max_num_seqs` and cache allow, and never in a step that preempted; with
prefix caching an admitted sequence starts at its hit length (pages shared, state copied). The
oldest running sequence always makes progress, so no request starves.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..cache.manager import CacheManager
from .sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int

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

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            while not self.cache.grow(seq.seq_id, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hit = self.cache.lookup(seq.all_ids(), seq.cache_salt, seq.prefix_hashes) if self.cache.prefix_enabled else None
            start = hit.length if hit is not None else 0
            n = min(seq.num_tokens - start, budget)
            if not self.cache.admit(seq.seq_id, start + n, hit, len(seq.prompt_ids)):
                break
            seq.num_computed = start
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out
