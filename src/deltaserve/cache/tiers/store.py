"""`TieredStore`: host memory, local disk and a shared store under the device pools, as one
`LowerTier`; lookups try them in that order.

Write-through: each checkpoint the device index registers becomes a tier object at once
(`objects.snapshot`): the MLA rows since the deepest object already stored on its chain (its
parent) plus the checkpoint, kept by the host tier and queued for the disk and shared tiers
(`shared.SharedTier`, `--kv-store`). Device eviction
then keeps nothing (the objects are below); each tier evicts by its own LRU and size limit, and a
use or a new child makes the whole parent chain most recently used, so parents outlive children.

Restore (`restore`, from `CacheManager.lookup`): the longest prefix of the request's chain whose
checkpoint object is held in a tier and whose MLA units are held on the device or by the object's
ancestors (host first, then disk). Disk objects are first read and verified by the disk tier's
reader thread while the engine keeps stepping (the lookup answers "pending" and the scheduler
holds the request), then promoted to the host tier; once every object is in memory the prefix is
installed into fresh device pages and a checkpoint slot, registered in the device index and tagged
as a local checkpoint would be, before the admission that uses it. With a shared tier, a lookup
that the local tiers cannot serve in full first probes the store for the rest of the chain (held
at most `SharedTier.wait_s`; objects other instances wrote become known there) and then restores
as from disk. The device units the restore
chains onto are pinned while it takes pages. A verification failure is a counted miss and a
shorter prefix is tried; a restore without room in the pools does nothing (counted).
`resumable` answers, read-only, how far a restore from each local tier would reach (for the
proxy's `/disagg/match`).
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

from ..plan import parse_bytes
from .disk import DiskTier
from .host import HostTier
from .mooncake import MooncakeClient
from .objects import Meta, TierObject, install, snapshot, tier_fingerprint
from .shared import SharedTier

Tier = HostTier | DiskTier | SharedTier


class TieredStore:
    def __init__(self, host: HostTier | None = None, disk: DiskTier | None = None, store: SharedTier | None = None):
        if host is None and disk is None and store is None:
            raise ValueError("a tiered store needs a host, a disk or a shared tier")
        self.host, self.disk, self.store = host, disk, store
        self.tiers = [t for t in (host, disk, store) if t is not None]
        self.readers = [t for t in (disk, store) if t is not None]  # read off the engine thread
        self.counters: Counter[str] = Counter()
        self.read_ahead = True  # disk objects are read off the engine thread (False: in the lookup)
        self._since: dict[bytes, float] = {}  # restore target -> when its first read began

    def take_unit(self, h, parent, pages, pool) -> None:
        return None  # written through when its checkpoint was stored

    def take_checkpoint(self, h, slot, pool) -> None:
        return None

    def _find(self, key: bytes, pending: bool = False, shared: bool = True) -> tuple[Meta, Tier] | None:
        if self.host is not None and (m := self.host.meta(key)) is not None:
            return m, self.host
        for t in self.readers:
            if (shared or t is not self.store) and (m := t.meta(key, pending)) is not None:
                return m, t
        return None

    def _touch_chain(self, key: bytes) -> None:
        """Make the object at `key` and its ancestors most recently used, deepest first."""
        while key and (found := self._find(key)) is not None:
            for t in self.tiers:
                t.touch(key)
            key = found[0].parent

    def stored(self, cache, hashes: list[bytes], k: int, slot: int) -> None:
        key = hashes[k - 1]
        if self._find(key, pending=True) is not None:
            self._touch_chain(key)
            return
        start = next((j for j in range(k - 1, 0, -1) if self._find(hashes[j - 1], pending=True)), 0)
        obj = snapshot(cache, hashes, start, k, slot)
        if self.host is not None:
            self.host.put(obj)
        for t in self.readers:
            t.submit(obj)
        if start:
            self._touch_chain(hashes[start - 1])

    def _plan(self, hashes: list[bytes], k: int, k_dev: int) -> list[tuple[Meta, Tier]] | None:
        """The objects, shallowest first, that restore units `[k_dev, k)` and the checkpoint at
        `k` of `hashes`, or None if a link is missing or names another chain."""
        plan, end = [], k
        while True:
            found = self._find(hashes[end - 1])
            if found is None:
                return None
            m = found[0]
            parent = hashes[m.start - 1] if m.start else b""
            if m.key != hashes[end - 1] or m.end != end or not 0 <= m.start < end or m.parent != parent:
                return None
            plan.append(found)
            if m.start <= k_dev:
                return plan[::-1]
            end = m.start

    def _fetch(self, plan: list[tuple[Meta, Tier]]) -> list[TierObject] | None:
        objs = []
        for m, tier in plan:
            if tier is self.host:
                obj = self.host.get(m.key)
            elif tier is self.store:
                obj = tier.take(m.key)  # never a store call on the engine thread
            else:
                obj = tier.take(m.key) or tier.read(m.key)
            if obj is None:
                return None
            if tier is not self.host and self.host is not None:
                self.host.put(obj)
            objs.append(obj)
        return objs

    def _probe(self, hashes: list[bytes], k_mla: int, k_hit: int) -> bool:
        """Ask the shared tier for the part of the chain past what the tiers know (True: wait)."""
        if self.store is None:
            return False
        lo, local = k_hit, set()
        for k in range(k_hit + 1, len(hashes) + 1):
            if self._find(hashes[k - 1], shared=False) is not None:
                lo = k
                local.add(hashes[k - 1])
            elif self.store.meta(hashes[k - 1]) is not None:
                lo = k
        return self.store.probe(hashes, lo, k_mla, local)

    def _wait(self, hashes: list[bytes]) -> None:
        self.counters["restore_waits"] += 1
        if len(self._since) > 4096:  # targets whose requests left before their restore
            self._since.clear()
        self._since.setdefault(hashes[-1], time.perf_counter())

    def restore(self, cache, hashes: list[bytes], k_mla: int, k_hit: int) -> bool | None:
        """True: a longer prefix is in the device index now; None: the store is being probed or
        the objects it needs are being read (the caller holds the request and asks again);
        False: nothing to restore."""
        if self._probe(hashes, k_mla, k_hit):
            self._wait(hashes)
            return None
        for k in range(len(hashes), k_hit, -1):
            if self._find(hashes[k - 1]) is None:
                continue
            k_dev = min(k_mla, k)
            plan = self._plan(hashes, k, k_dev)
            if plan is None:
                continue
            unread = [(m.key, t) for m, t in plan if t in self.readers and m.key not in t.staged]
            if unread and self.read_ahead:
                for key, t in unread:
                    t.prefetch(key)
                self._wait(hashes)
                return None
            t0 = self._since.pop(hashes[-1], None) or time.perf_counter()
            held = cache.index.pages_of(hashes, k_dev)
            cache.mla.incref(held)  # the device units the restore chains onto stay while it takes pages
            try:
                done = self._restore(cache, hashes, k, k_dev, plan)
            finally:
                cache.mla.release(held)
            if done is None:
                continue  # a verification miss: try a shorter prefix
            tier = plan[-1][1].name
            if not done:
                self.counters["restore_no_room"] += 1
                return False
            self.counters[f"{tier}_hits"] += 1
            self.counters[f"{tier}_hit_tokens"] += (k - k_hit) * cache.policy.unit
            self.counters[f"{tier}_restore_seconds"] += time.perf_counter() - t0
            self._touch_chain(hashes[k - 1])
            return True
        if hashes:
            self._since.pop(hashes[-1], None)
        return False

    def resumable(self, hashes: list[bytes], k_mla: int) -> dict[str, int]:
        """Per local tier (host, disk): the longest k whose checkpoint object it holds and whose
        `_plan` (the one `restore` follows, device units up to `k_mla`) is complete. Index
        lookups only: no object is read, nothing is made recently used."""
        local = [t for t in (self.host, self.disk) if t is not None]
        out: dict[str, int] = {}
        for k in range(len(hashes), 0, -1):
            held = [t.name for t in local if t.name not in out and t.meta(hashes[k - 1]) is not None]
            if held and self._plan(hashes, k, min(k_mla, k)) is not None:
                out.update(dict.fromkeys(held, k))
                if len(out) == len(local):
                    break
        return out

    def _restore(self, cache, hashes: list[bytes], k: int, k_dev: int, plan) -> bool | None:
        """Install the plan; False (nothing taken) without room, None after a verification miss."""
        per_unit = cache.policy.unit // cache.page_size
        n = (k - k_dev) * per_unit
        if n > cache.mla.num_free + cache.index.reclaimable_pages():
            return False
        if cache.ckpt_pool.num_free == 0 and all(h in cache.index.pinned for h in cache.index.ckpts):
            return False
        objs = self._fetch(plan)
        if objs is None:
            return None
        fresh = cache._take_pages(n) if n else []
        if fresh is None:
            return False
        slot = cache._ckpt_slot()
        if slot is None:
            cache.mla.release(fresh)
            return False
        install(cache, objs, k_dev, fresh, slot)
        for j in range(k_dev, k):
            pages = fresh[(j - k_dev) * per_unit : (j - k_dev + 1) * per_unit]
            cache.index.add_unit(hashes[j], hashes[j - 1] if j else None, pages)
        cache.mla.release(fresh)  # the index holds them now
        cache.ckpt_pool.tags[slot] = cache.tag(hashes[k - 1], k * cache.policy.unit)
        if not cache.index.add_checkpoint(hashes[k - 1], slot):
            cache.ckpt_pool.release(slot)
        return True

    def flush(self) -> None:
        """Wait until every queued disk and store write is done."""
        for t in self.readers:
            t.flush()

    def close(self) -> None:
        for t in self.readers:
            t.close()

    def stats(self) -> dict:
        """Per tier: its own counters and usage, plus the restores served from it (`hits`,
        `hit_tokens` beyond the device hit, `restore_seconds` summed: from the lookup that
        started the reads to the prefix in the device pools)."""
        out: dict = {k: self.counters[k] for k in ("restore_no_room", "restore_waits")}
        for t in self.tiers:
            s = t.stats()
            for c in ("hits", "hit_tokens", "restore_seconds"):
                s[c] = self.counters[f"{t.name}_{c}"]
            out[t.name] = s
        return out


def _size(v: int | str) -> int:
    return parse_bytes(v) if isinstance(v, str) else int(v)


def build_store(
    cache, host_bytes, disk_path, disk_bytes, world: int = 1, store_url=None, store_bytes=None
) -> TieredStore:
    """The store of `--kv-offload-memory` (bytes or '8GiB', None: no host tier),
    `--kv-disk-path` (None: no disk tier) / `--kv-disk-size` (None: half the free space there) and
    `--kv-store` (`mooncake://HOST:PORT`, None: no shared tier) / `--kv-store-size` (host memory
    lent to the store; None: none)."""
    host = HostTier(_size(host_bytes)) if host_bytes is not None else None
    disk = store = None
    fingerprint = tier_fingerprint(cache, world)
    if disk_path is not None:
        Path(disk_path).mkdir(parents=True, exist_ok=True)
        size = _size(disk_bytes) if disk_bytes is not None else shutil.disk_usage(disk_path).free // 2
        disk = DiskTier(disk_path, size, fingerprint)
    if store_url is not None:
        lend = _size(store_bytes) if store_bytes is not None else 0
        try:
            store = SharedTier(MooncakeClient(store_url, lend), fingerprint, lend)
        except BaseException:
            if disk is not None:
                disk.close()
            raise
    return TieredStore(host, disk, store)


def close_tiers(cache) -> None:
    """Write what the disk and shared tiers have queued and release them (idempotent)."""
    close = getattr(cache.tier, "close", None)
    if close is not None:
        close()
