"""Routing on resumable prefixes (engine/dp/routing.py over cache/events.py): a request goes where
the longest prefix of its hash chain can resume (device over host over disk), load outweighs a
short prefix and breaks ties, a named session stays on its replica, an eviction or a dead replica
moves routing away, the index is bounded; the cache publishes exactly the boundaries it can
resume (device checkpoints, host and disk objects), a reset after an overflow, and the events
round-trip as msgpack."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import torch

from deltaserve.cache.events import DEVICE, DISK, HOST, CacheEvent, CacheEvents, EventLog, publish, short
from deltaserve.cache.kda_pool import KdaStatePool
from deltaserve.cache.mla_pool import MlaPagePool
from deltaserve.cache.prefix_index import PrefixIndex
from deltaserve.cache.tiers.host import HostTier
from deltaserve.cache.tiers.objects import Meta, TierObject
from deltaserve.engine.dp.routing import LOAD_WEIGHT, SPILL, Router, prompt_hashes

UNIT = 4
MODEL = "m"


def chain(n: int, seed: int = 0) -> list[bytes]:
    return prompt_hashes([seed * 1000 + i for i in range(n * UNIT + 1)], MODEL, None, UNIT)


def held(*items: tuple[bytes, int]) -> CacheEvents:
    return CacheEvents([CacheEvent(short(h), tier, True) for h, tier in items])


def test_the_longest_resumable_prefix_wins_weighted_by_tier():
    r, h = Router(), chain(8)
    r.index.apply(0, held((h[1], DEVICE)))  # 2 of 8 units on the device
    r.index.apply(1, held((h[5], DEVICE)))  # 6 of 8
    assert r.route(b"k", h, [0, 0], [0, 1]) == r.route(b"k", h, [0, 0], [0, 1])
    assert r.route(b"k", h, [0, 0], [0, 1]).replica == 1
    r.index.apply(0, held((h[7], DISK)))  # 8 units on disk weigh 0.5, under 6/8 on the device
    got = r.route(b"k", h, [0, 0], [0, 1])
    assert (got.replica, got.reason, got.resumed) == (1, "resume_device", 6)
    r.index.apply(0, held((h[7], HOST)))  # 8 units in host memory: 0.75 * 8/8 = 6/8 on the device: tie
    assert r.route(b"k", h, [0, 0], [0, 1]).replica in (0, 1)
    r.index.apply(0, held((h[6], DEVICE)))  # 7 of 8 on the device beats 6
    got = r.route(b"k", h, [0, 0], [0, 1])
    assert (got.replica, got.reason, got.resumed) == (0, "resume_device", 7)
    assert r.decisions["resume_device"] >= 3


def test_an_eviction_event_moves_routing_away():
    r, h = Router(), chain(4)
    r.index.apply(0, held((h[3], DEVICE)))
    r.index.apply(1, held((h[1], DEVICE)))
    assert r.route(b"k", h, [0, 0], [0, 1]).replica == 0
    r.index.apply(0, CacheEvents([CacheEvent(short(h[3]), DEVICE, False)]))
    got = r.route(b"k", h, [0, 0], [0, 1])
    assert (got.replica, got.resumed) == (1, 2)
    r.index.apply(1, CacheEvents([], reset=True))  # a reset with nothing: replica 1 holds nothing now
    assert r.route(b"k", h, [0, 0], [0, 1]).reason in ("hash", "load")
    assert r.index.held == {}


def test_load_breaks_ties_and_outweighs_a_short_prefix():
    r, h = Router(), chain(10)
    r.index.apply(0, held((h[9], DEVICE)))
    r.index.apply(1, held((h[9], DEVICE)))
    assert r.route(b"k", h, [3, 1], [0, 1]).replica == 1
    assert r.route(b"k", h, [1, 3], [0, 1]).replica == 0
    r.index.apply(0, CacheEvents([CacheEvent(short(h[9]), DEVICE, False)]))
    r.index.apply(0, held((h[0], DEVICE)))  # 1 of 10 units: worth 0.1 = one request of load
    busy = int(0.1 / LOAD_WEIGHT) + 1
    got = r.route(b"k", h[:1], [0, 0], [0, 1])
    assert (got.replica, got.reason) == (0, "resume_device")
    h2 = h[:1] + chain(9, 5)  # shares only the first unit with what replica 0 holds
    got = r.route(b"k", h2, [busy, 0], [0, 1])
    assert (got.replica, got.reason) == (1, "load")


def test_a_named_session_stays_on_its_replica():
    r, h, other = Router(), chain(4), chain(4, 7)
    r.index.apply(1, held((other[3], DEVICE)))
    first = r.route(b"k", h, [0, 0], [0, 1], session="s1")
    assert first.reason in ("hash", "load")
    r.index.apply(1 - first.replica, held((h[3], DEVICE)))  # the other replica holds its prefix now
    again = r.route(b"k", h, [0, 0], [0, 1], session="s1")
    assert (again.replica, again.reason) == (first.replica, "affinity")
    loads = [0, 0]
    loads[first.replica] = SPILL
    assert r.route(b"k", h, loads, [0, 1], session="s1").reason == "affinity"
    loads[first.replica] = SPILL + 1  # over SPILL busier: it moves, and the session with it
    moved = r.route(b"k", h, loads, [0, 1], session="s1")
    assert moved.replica == 1 - first.replica and r.sessions["s1"] == moved.replica
    assert r.decisions["affinity"] == 2
    r.forget(r.sessions["s1"])
    assert "s1" not in r.sessions


def test_a_dead_replicas_entries_are_dropped_and_the_index_is_bounded():
    r, h = Router(index_cap=3, sessions_cap=2), chain(6)
    r.index.apply(0, held(*((x, DEVICE) for x in h[:2])))
    r.index.apply(1, held(*((x, HOST) for x in h[:4])))
    assert len(r.index.held) == 3  # the cap: the least recently stored went
    assert short(h[0]) not in r.index.held and r.index.count(1) == 3
    r.route(b"a", h, [0, 0], [0, 1], session="a")
    r.route(b"b", h, [0, 0], [0, 1], session="b")
    r.route(b"c", h, [0, 0], [0, 1], session="c")
    assert list(r.sessions) == ["b", "c"]
    r.forget(1)
    assert r.index.count(1) == 0 and all(1 not in where for where in r.index.held.values())
    assert r.index.count(0) == 1 and r.route(b"k", h, [0, 0], [0, 1]).replica == 0
    assert all(i != 1 for i in r.sessions.values())


def test_events_round_trip_as_msgpack():
    batch = CacheEvents([CacheEvent(bytes([i]) * 16, HOST, i % 2 == 0) for i in range(100)], reset=True)
    data = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(data, type=CacheEvents) == batch
    assert len(data) <= 100 * 21 + 40  # 21 bytes an event: a 16-byte key, tier, stored
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "cache_events", "events": [[1, 2]]}), type=CacheEvents)


def test_the_log_resets_after_an_overflow():
    log = EventLog(cap=3)
    log.add_source(lambda: [(b"a" * 32, DEVICE)])
    first = log.drain()
    assert first.reset and [e.key for e in first.events] == [b"a" * 16]
    assert log.drain() is None
    log.emit(b"b" * 32, HOST, True)
    assert log.drain() == CacheEvents([CacheEvent(b"b" * 16, HOST, True)])
    for i in range(4):
        log.emit(bytes([i]) * 32, DEVICE, True)
    assert log.drain().reset  # events were lost: the consumer gets the whole set again


def _cache() -> SimpleNamespace:
    mla = MlaPagePool([0], num_pages=6, page_size=UNIT, row_dim=3, dtype=torch.float32)
    ck = KdaStatePool([1], num_slots=2, tail_shape=(1, 2), state_shape=(1, 2, 2), tail_dtype=torch.float32)
    return SimpleNamespace(index=PrefixIndex(mla, ck), tier=SimpleNamespace(host=HostTier(100), disk=None))


def test_the_cache_publishes_its_device_checkpoints_and_tier_objects():
    cache, log = _cache(), EventLog()
    host = cache.tier.host
    publish(cache, log)
    assert log.drain() == CacheEvents([], reset=True)
    h = chain(3)
    pages = cache.index.mla.allocate(1)
    cache.index.add_unit(h[0], None, pages)
    cache.index.mla.release(pages)
    cache.index.add_checkpoint(h[0], cache.index.ckpt_pool.allocate())
    host.put(TierObject(Meta(h[1], h[0], 1, 2, 60), None, None, None))
    host.put(TierObject(Meta(h[2], h[1], 2, 3, 60), None, None, None))  # over the limit: h[1] goes
    cache.index.evict_checkpoint()
    got = log.drain().events
    want = [(h[0], DEVICE, True), (h[1], HOST, True), (h[2], HOST, True), (h[1], HOST, False), (h[0], DEVICE, False)]
    assert got == [CacheEvent(short(a), t, s) for a, t, s in want]
    log.resync()
    assert log.drain() == CacheEvents([CacheEvent(short(h[2]), HOST, True)], reset=True)


def test_the_disk_tier_publishes_what_it_writes_evicts_and_finds_at_start(tmp_path):
    """Writes and evictions (on the writer thread) and a dropped corrupt file are told; objects
    found on disk at start are in the first reset."""
    from deltaserve.cache.tiers.disk import DiskTier
    from deltaserve.cache.tiers.objects import encode
    from tests.cache.test_tiers import FP, obj

    objs = [obj(i) for i in range(3)]
    size = len(encode(objs[0], FP))
    cache, log = _cache(), EventLog()
    disk = DiskTier(tmp_path, 2 * size, FP)
    cache.tier = SimpleNamespace(host=None, disk=disk)
    publish(cache, log)
    assert log.drain() == CacheEvents([], reset=True)
    for o in objs:
        disk.submit(o)
        disk.flush()
    keys = [short(o.meta.key) for o in objs]
    want = [(keys[0], True), (keys[1], True), (keys[2], True), (keys[0], False)]
    assert log.drain() == CacheEvents([CacheEvent(k, DISK, s) for k, s in want])
    disk.path(objs[1].meta.key).write_bytes(b"corrupt")
    assert disk.read(objs[1].meta.key) is None
    assert log.drain() == CacheEvents([CacheEvent(keys[1], DISK, False)])
    disk.close()
    again = DiskTier(tmp_path, 2 * size, FP)
    log = EventLog()
    cache.tier = SimpleNamespace(host=None, disk=again)
    publish(cache, log)
    assert log.drain() == CacheEvents([CacheEvent(keys[2], DISK, True)], reset=True)
    again.close()
