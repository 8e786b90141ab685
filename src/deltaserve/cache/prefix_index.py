"""Index of reusable cache: MLA units (the pages of one match unit, keyed by its chain hash)
and KDA checkpoints (a checkpoint-pool slot holding the state at exactly one unit boundary).

Invariants: the units form a forest (a unit's parent is the previous unit of its chain); only
leaf units that no checkpoint pins and no sequence shares (every page's refcount is the index's
own 1) are evicted, so a checkpoint's MLA pages live at least as long as the checkpoint. A
checkpoint that an admission is about to copy is pinned (`pin_checkpoint`) and never evicted
until unpinned. LRU order: `OrderedDict`s, most recently used last. What eviction takes is handed
to the index's lower tier (`tiers.LowerTier`; `tiers.DROP` keeps nothing) before it is freed.
Every checkpoint registered or dropped is told to `events` (`events.EventLog`), when set: a device
checkpoint is a boundary resumable here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

from .events import DEVICE, EventLog
from .kda_pool import KdaStatePool
from .mla_pool import MlaPagePool
from .tiers import DROP, LowerTier


@dataclass
class UnitEntry:
    parent: bytes | None
    pages: list[int]
    children: int = 0
    pins: int = 0


class PrefixIndex:
    def __init__(self, mla: MlaPagePool, checkpoints: KdaStatePool, tier: LowerTier = DROP):
        self.mla, self.ckpt_pool, self.tier = mla, checkpoints, tier
        self.units: OrderedDict[bytes, UnitEntry] = OrderedDict()
        self.ckpts: OrderedDict[bytes, int] = OrderedDict()
        self.evicted_units = 0
        self.evicted_checkpoints = 0
        self.pinned: Counter[bytes] = Counter()
        self.events: EventLog | None = None

    def match(self, hashes: list[bytes]) -> tuple[int, int]:
        """(k_mla, k_hit): the number of leading units cached, and the largest k <= k_mla with a
        checkpoint at unit boundary k (0 if none)."""
        k_mla = 0
        while k_mla < len(hashes) and hashes[k_mla] in self.units:
            k_mla += 1
        for k in range(k_mla, 0, -1):
            if hashes[k - 1] in self.ckpts:
                return k_mla, k
        return k_mla, 0

    def touch(self, hashes: list[bytes], k: int) -> None:
        """Mark the cached ones of the first `k` units (and a checkpoint at k) most recently used."""
        for h in hashes[:k]:
            if h in self.units:
                self.units.move_to_end(h)
        if k and hashes[k - 1] in self.ckpts:
            self.ckpts.move_to_end(hashes[k - 1])

    def pin_checkpoint(self, h: bytes) -> None:
        if h not in self.ckpts:
            raise KeyError("pin of a checkpoint that is not cached")
        self.pinned[h] += 1

    def unpin_checkpoint(self, h: bytes) -> None:
        self.pinned[h] -= 1
        if self.pinned[h] <= 0:
            del self.pinned[h]

    @contextmanager
    def pinned_checkpoint(self, h: bytes):
        """The checkpoint at `h` pinned for the block."""
        self.pin_checkpoint(h)
        try:
            yield
        finally:
            self.unpin_checkpoint(h)

    def pages_of(self, hashes: list[bytes], k: int) -> list[int]:
        return [p for h in hashes[:k] for p in self.units[h].pages]

    def add_unit(self, h: bytes, parent: bytes | None, pages: list[int]) -> bool:
        """Register a completed unit; the index takes its own reference on the pages."""
        if h in self.units:
            self.units.move_to_end(h)
            return False
        if parent is not None:
            self.units[parent].children += 1
        self.mla.incref(pages)
        self.units[h] = UnitEntry(parent, list(pages))
        return True

    def add_checkpoint(self, h: bytes, slot: int) -> bool:
        """Register `slot` as the checkpoint at boundary `h` (whose unit must be cached); False
        if one exists already (the caller keeps `slot`)."""
        if h in self.ckpts:
            self.ckpts.move_to_end(h)
            return False
        self.units[h].pins += 1
        self.ckpts[h] = slot
        if self.events is not None:
            self.events.emit(h, DEVICE, True)
        return True

    def _evictable(self, e: UnitEntry) -> bool:
        return e.children == 0 and e.pins == 0 and all(self.mla.refcount[p] == 1 for p in e.pages)

    def reclaimable_pages(self) -> int:
        """The most that eviction can free: pages only the index holds, of units that can become
        leaves. A unit whose pages a sequence shares, or whose checkpoint an admission pinned, is
        never evicted, and so neither is any unit above it (counting those made a failing
        admission flush the cache for nothing, and could preempt a request forever)."""
        blocked: set[bytes] = set()
        for h, e in self.units.items():
            if h in self.pinned or any(self.mla.refcount[p] > 1 for p in e.pages):
                while h is not None and h not in blocked:
                    blocked.add(h)
                    h = self.units[h].parent
        return sum(1 for h, e in self.units.items() if h not in blocked for p in e.pages if self.mla.refcount[p] == 1)

    def evict_unshared(self) -> None:
        """Evict every unit that can become a leaf (as far as sequences and pins allow)."""
        while self._sweep(self.mla.num_pages + 1):
            pass

    def evict_pages(self, needed: int) -> None:
        """Evict LRU evictable units until `needed` pages are free; evicting a leaf may make
        its parent a leaf, so sweep until no progress, then unpin units by evicting the LRU
        checkpoint and sweep again. Only pages that running sequences share survive, so the
        index can always give back everything else. Where even that would not make `needed`
        pages free, nothing is evicted (the caller waits or preempts; the cache stays useful)."""
        if self.mla.num_free + self.reclaimable_pages() < needed:
            return
        while self.mla.num_free < needed:
            if not self._sweep(needed) and not self.evict_checkpoint():
                return

    def _sweep(self, needed: int) -> bool:
        progress = False
        for h in list(self.units):
            if self.mla.num_free >= needed:
                break
            e = self.units[h]
            if self._evictable(e):
                self._drop_unit(h, e)
                progress = True
        return progress

    def _drop_unit(self, h: bytes, e: UnitEntry) -> None:
        self.tier.take_unit(h, e.parent, e.pages, self.mla)
        del self.units[h]
        if e.parent is not None:
            self.units[e.parent].children -= 1
        self.mla.release(e.pages)
        self.evicted_units += 1

    def evict_checkpoint(self) -> bool:
        """Free the least recently used unpinned checkpoint's slot; False if there is none."""
        h = next((h for h in self.ckpts if h not in self.pinned), None)
        if h is None:
            return False
        self.tier.take_checkpoint(h, self.ckpts[h], self.ckpt_pool)
        self.drop_checkpoint(h)
        self.evicted_checkpoints += 1
        return True

    def drop_checkpoint(self, h: bytes) -> None:
        """Forget the checkpoint at `h` and free its slot (eviction, or a refused restore)."""
        if h in self.pinned:
            raise RuntimeError("drop of a pinned checkpoint")
        slot = self.ckpts.pop(h)
        self.units[h].pins -= 1
        self.ckpt_pool.release(slot)
        if self.events is not None:
            self.events.emit(h, DEVICE, False)

    def page_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for e in self.units.values():
            for p in e.pages:
                refs[p] = refs.get(p, 0) + 1
        return refs

    def check_integrity(self) -> None:
        children: dict[bytes, int] = {}
        for e in self.units.values():
            if e.parent is not None:
                if e.parent not in self.units:
                    raise AssertionError("cached unit whose parent was evicted")
                children[e.parent] = children.get(e.parent, 0) + 1
        pins: dict[bytes, int] = {}
        for h in self.ckpts:
            if h not in self.units:
                raise AssertionError("checkpoint whose MLA unit is not cached")
            pins[h] = pins.get(h, 0) + 1
        for h, e in self.units.items():
            if e.children != children.get(h, 0) or e.pins != pins.get(h, 0):
                raise AssertionError("prefix index child/pin counts disagree")
        if any(h not in self.ckpts for h in self.pinned):
            raise AssertionError("a pinned checkpoint is not cached")
