"""`CacheManager`: the pools plus who owns what. The scheduler asks it for slots and pages; the
runner reads block tables and slot ids from it.

Invariants (checked by `check_integrity`): every page's refcount equals the number of sequences
whose block table lists it, every owned slot belongs to exactly one sequence, and
free + used == capacity for both pools.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .kda_pool import KdaStatePool
from .mla_pool import MlaPagePool


@dataclass
class SeqCache:
    slot: int
    pages: list[int] = field(default_factory=list)


class CacheManager:
    def __init__(self, mla: MlaPagePool, kda: KdaStatePool):
        self.mla, self.kda = mla, kda
        self.page_size = mla.page_size
        self.seqs: dict[int, SeqCache] = {}

    def can_admit(self, num_tokens: int) -> bool:
        return self.kda.num_free > 0 and self.mla.pages_for(num_tokens) <= self.mla.num_free

    def admit(self, seq_id: int, num_tokens: int) -> bool:
        """Give a new sequence a zeroed slot and pages for `num_tokens`; False (nothing taken) if
        either pool is short."""
        if seq_id in self.seqs:
            raise RuntimeError(f"sequence {seq_id} already holds cache")
        if not self.can_admit(num_tokens):
            return False
        self.seqs[seq_id] = SeqCache(self.kda.allocate(), self.mla.allocate(self.mla.pages_for(num_tokens)))
        return True

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make the sequence's pages cover `num_tokens` tokens; False (nothing taken) if short."""
        sc = self.seqs[seq_id]
        extra = self.mla.pages_for(num_tokens) - len(sc.pages)
        if extra <= 0:
            return True
        if extra > self.mla.num_free:
            return False
        sc.pages.extend(self.mla.allocate(extra))
        return True

    def free(self, seq_id: int) -> None:
        sc = self.seqs.pop(seq_id, None)
        if sc is None:
            return
        self.mla.release(sc.pages)
        self.kda.release(sc.slot)

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        slots: dict[int, int] = {}
        for sc in self.seqs.values():
            for p in sc.pages:
                refs[p] = refs.get(p, 0) + 1
            slots[sc.slot] = slots.get(sc.slot, 0) + 1
        self.mla.check_integrity(refs)
        self.kda.check_integrity(slots)

    def usage(self) -> dict[str, int]:
        return {"mla_pages_total": self.mla.num_pages, "mla_pages_used": self.mla.num_used,
                "kda_slots_total": self.kda.num_slots, "kda_slots_used": self.kda.num_used,
                "page_size": self.page_size}
