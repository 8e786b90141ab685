"""Resumable-prefix events: what a replica tells a router about where a prefix can resume.

A boundary is *resumable* in a tier when its MLA pages and the KDA checkpoint at it are both
there. On the device a checkpoint pins its unit and a unit its ancestors (`PrefixIndex`), so a
device checkpoint at `h` means "resumable at `h`"; a host or disk tier object at `h` holds the
checkpoint and chains to its ancestors' objects. Each event is compact: the first `KEY_BYTES` of
the boundary's chain hash, the tier code (`TIERS`), stored or evicted.

`EventLog` is the queue between the cache (engine thread; the disk tier's writer thread) and
the one consumer that drains it (a replica's link or its event stream). It is bounded: past `cap`
pending events the oldest are dropped and the next `drain` is a *reset*: the full set of
resumable boundaries (`snapshot`) replaces whatever the consumer knew. A new consumer asks for a
reset too. Invariant: a consumer that applies every drained batch in order (a reset first clearing
what it knew of this replica) knows exactly the boundaries resumable here as of the drain.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

import msgspec

TIERS = ("device", "host", "disk")  # tier codes are indices; a lower code is a faster tier
DEVICE, HOST, DISK = range(3)
KEY_BYTES = 16  # leading bytes of a sha256 chain hash that name a boundary in events
EVENTS_CAP = 1 << 16  # pending events an `EventLog` keeps before it falls back to a reset


class CacheEvent(msgspec.Struct, array_like=True, frozen=True):
    key: bytes  # `short(chain hash)` of the boundary
    tier: int  # index into `TIERS`
    stored: bool  # False: evicted


class CacheEvents(msgspec.Struct, tag="cache_events", frozen=True):
    """A drained batch; `reset`: forget what this replica published before, then apply."""

    events: list[CacheEvent]
    reset: bool = False


def short(h: bytes) -> bytes:
    return h[:KEY_BYTES]


class EventLog:
    def __init__(self, cap: int = EVENTS_CAP):
        self.cap = cap
        self._lock = threading.Lock()
        self._pending: deque[CacheEvent] = deque()
        self._lost = True  # the first drain is a reset
        self._sources: list[Callable[[], Iterable[tuple[bytes, int]]]] = []

    def emit(self, h: bytes, tier: int, stored: bool) -> None:
        with self._lock:
            if len(self._pending) >= self.cap:
                self._pending.clear()
                self._lost = True
            if not self._lost:
                self._pending.append(CacheEvent(short(h), tier, stored))

    def add_source(self, source: Callable[[], Iterable[tuple[bytes, int]]]) -> None:
        """`source()`: the (chain hash, tier) of every boundary one tier holds now (for resets)."""
        self._sources.append(source)

    def resync(self) -> None:
        """The next `drain` is a reset (a new consumer knows nothing yet)."""
        with self._lock:
            self._pending.clear()
            self._lost = True

    def waiting(self) -> bool:
        """Whether the next `drain` has something (any thread)."""
        with self._lock:
            return self._lost or bool(self._pending)

    def drain(self) -> CacheEvents | None:
        """What happened since the last drain (None: nothing), or a reset; on the engine thread."""
        with self._lock:
            if self._lost:
                self._lost = False
                self._pending.clear()
                reset = True
            elif not self._pending:
                return None
            else:
                events, reset = list(self._pending), False
                self._pending.clear()
        if not reset:
            return CacheEvents(events)
        snap = [CacheEvent(short(h), tier, True) for source in self._sources for h, tier in source()]
        return CacheEvents(snap, reset=True)


def publish(cache, log: EventLog) -> None:
    """Tell `log` what `cache` (a `CacheManager` with the prefix cache on) and its host and disk
    tiers, if any, hold and from now on store and evict (on the engine thread, before serving)."""
    index = cache.index
    index.events = log
    log.add_source(lambda: [(h, DEVICE) for h in index.ckpts])
    for code, tier in ((HOST, getattr(cache.tier, "host", None)), (DISK, getattr(cache.tier, "disk", None))):
        if tier is None:
            continue
        tier.on_change = lambda key, stored, code=code: log.emit(key, code, stored)
        log.add_source(lambda tier=tier, code=code: [(k, code) for k in _tier_keys(tier)])


def _tier_keys(tier) -> list[bytes]:
    lock = getattr(tier, "lock", None)
    if lock is None:
        return list(tier.objects)
    with lock:
        return list(tier.index)
