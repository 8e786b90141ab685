"""Chained hashes and the prefix index: exact-boundary naming, salts, leaf-only LRU eviction,
checkpoints pinning their units."""

import torch

from deltaserve.cache.hashing import extend_hashes, root_hash
from deltaserve.cache.kda_pool import KdaStatePool
from deltaserve.cache.mla_pool import MlaPagePool
from deltaserve.cache.prefix_index import PrefixIndex


def test_hashes_name_exact_boundaries():
    root = root_hash("m")
    a = extend_hashes([], root, list(range(20)), 4)
    assert len(a) == 5
    b = extend_hashes([], root, list(range(11)) + [99] + list(range(12, 20)), 4)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3], "a change poisons every later unit"
    assert extend_hashes(a[:2], root, list(range(20)), 4) == a, "incremental == from scratch"
    assert extend_hashes([], root_hash("m", "salt"), list(range(20)), 4)[0] != a[0]
    assert extend_hashes([], root_hash("other"), list(range(20)), 4)[0] != a[0]
    assert root_hash("ab", "c") != root_hash("a", "bc"), "keys are length-prefixed"


def test_eviction_takes_leaves_and_respects_pins():
    mla = MlaPagePool([0], num_pages=6, page_size=2, row_dim=3, dtype=torch.float32)
    ck = KdaStatePool([1], num_slots=2, tail_shape=(1, 2), state_shape=(1, 2, 2), tail_dtype=torch.float32)
    idx = PrefixIndex(mla, ck)
    hs = extend_hashes([], root_hash("m"), list(range(9)), 3)
    pages = mla.allocate(6)
    for k, h in enumerate(hs):
        idx.add_unit(h, hs[k - 1] if k else None, pages[2 * k : 2 * k + 2])
    mla.release(pages)  # the sequence finished: only the index holds them
    slot = ck.allocate()
    idx.add_checkpoint(hs[1], slot)
    assert idx.match(hs) == (3, 2)
    idx.evict_pages(2)
    assert list(idx.units) == hs[:2], "only the unpinned leaf went"
    idx.check_integrity()
    idx.evict_pages(6)
    assert not idx.units and not idx.ckpts and mla.num_free == 6 and ck.num_free == 2
    assert idx.evicted_checkpoints == 1 and idx.evicted_units == 3


def test_shared_pages_are_never_evicted():
    mla = MlaPagePool([0], num_pages=4, page_size=2, row_dim=3, dtype=torch.float32)
    ck = KdaStatePool([1], num_slots=1, tail_shape=(1, 2), state_shape=(1, 2, 2), tail_dtype=torch.float32)
    idx = PrefixIndex(mla, ck)
    h = extend_hashes([], root_hash("m"), [1, 2], 2)
    pages = mla.allocate(1)
    idx.add_unit(h[0], None, pages)  # still held by its running sequence
    idx.evict_pages(4)
    assert h[0] in idx.units and mla.refcount[pages[0]] == 2


def test_eviction_that_cannot_make_room_takes_nothing():
    """Every cached page is shared by a running sequence: no eviction can free 2 pages, so the
    checkpoints (useful to the next request) stay; with room to win, they go as before."""
    mla = MlaPagePool([0], num_pages=3, page_size=2, row_dim=3, dtype=torch.float32)
    ck = KdaStatePool([1], num_slots=2, tail_shape=(1, 2), state_shape=(1, 2, 2), tail_dtype=torch.float32)
    idx = PrefixIndex(mla, ck)
    hs = extend_hashes([], root_hash("m"), list(range(4)), 2)
    pages = mla.allocate(3)
    idx.add_unit(hs[0], None, pages[:1])
    idx.add_unit(hs[1], hs[0], pages[1:2])  # both still held by their running sequence
    idx.add_checkpoint(hs[1], ck.allocate())
    assert idx.reclaimable_pages() == 0
    idx.evict_pages(2)
    assert hs[1] in idx.ckpts and idx.evicted_checkpoints == 0 and mla.num_free == 0
    mla.release(pages)  # the sequence finished: the index's pages are reclaimable again
    assert idx.reclaimable_pages() == 2
    idx.evict_pages(3)
    assert not idx.ckpts and mla.num_free == 3 and idx.evicted_checkpoints == 1
    idx.check_integrity()


def test_pinned_checkpoints_survive_eviction():
    """An admission pins the checkpoint its hit copies: eviction takes the next LRU one instead,
    and once every checkpoint is pinned, none is taken; the pinned unit's pages do not count as
    reclaimable, so an eviction that could not reach its target takes nothing."""
    mla = MlaPagePool([0], num_pages=4, page_size=2, row_dim=3, dtype=torch.float32)
    ck = KdaStatePool([1], num_slots=2, tail_shape=(1, 2), state_shape=(1, 2, 2), tail_dtype=torch.float32)
    idx = PrefixIndex(mla, ck)
    hs = extend_hashes([], root_hash("m"), list(range(4)), 2)
    pages = mla.allocate(2)
    idx.add_unit(hs[0], None, pages[:1])
    idx.add_unit(hs[1], hs[0], pages[1:])
    mla.release(pages)
    idx.add_checkpoint(hs[0], ck.allocate())
    idx.add_checkpoint(hs[1], ck.allocate())
    idx.pin_checkpoint(hs[0])  # the LRU one
    assert idx.evict_checkpoint() and list(idx.ckpts) == [hs[0]]
    assert not idx.evict_checkpoint(), "the only checkpoint left is pinned"
    idx.evict_pages(4)  # out of reach while hs[0] is pinned: nothing is evicted for nothing
    assert list(idx.units) == [hs[0], hs[1]] and mla.num_free == 2
    assert idx.reclaimable_pages() == 1
    idx.evict_pages(3)
    assert list(idx.units) == [hs[0]] and mla.num_free == 3, "its unit stays pinned too"
    idx.check_integrity()
    idx.unpin_checkpoint(hs[0])
    assert not idx.pinned and idx.evict_checkpoint() and not idx.ckpts
    idx.evict_pages(4)
    assert not idx.units and mla.num_free == 4 and ck.num_free == 2


class _Recorder:
    """A lower tier that copies what it is handed (the rows of a unit's pages, a checkpoint's state)."""

    def __init__(self):
        self.units, self.checkpoints = [], []

    def take_unit(self, h, parent, pages, pool):
        rows = pool.storage[0, torch.tensor(pages)].clone()
        self.units.append((h, parent, rows))

    def take_checkpoint(self, h, slot, pool):
        self.checkpoints.append((h, pool.read(1, torch.tensor([slot]))[1].clone()))


def test_eviction_hands_units_and_checkpoints_to_the_lower_tier():
    mla = MlaPagePool([0], num_pages=4, page_size=2, row_dim=3, dtype=torch.float32)
    ck = KdaStatePool([1], num_slots=1, tail_shape=(1, 2), state_shape=(1, 2, 2), tail_dtype=torch.float32)
    tier = _Recorder()
    idx = PrefixIndex(mla, ck, tier)
    hs = extend_hashes([], root_hash("m"), list(range(4)), 2)
    pages = mla.allocate(4)
    mla.storage.copy_(torch.arange(24, dtype=torch.float32).view_as(mla.storage))
    idx.add_unit(hs[0], None, pages[:2])
    idx.add_unit(hs[1], hs[0], pages[2:])
    mla.release(pages)
    slot = ck.allocate()
    ck.states[:, slot].fill_(7.0)
    idx.add_checkpoint(hs[1], slot)
    idx.evict_pages(4)
    assert [(h, parent) for h, parent, _ in tier.units] == [(hs[1], hs[0]), (hs[0], None)], "leaf first"
    expected = torch.arange(24, dtype=torch.float32).view(4, 2, 3)
    assert torch.equal(tier.units[0][2], expected[pages[2:]]) and torch.equal(tier.units[1][2], expected[pages[:2]])
    assert [h for h, _ in tier.checkpoints] == [hs[1]] and bool((tier.checkpoints[0][1] == 7.0).all())
    assert mla.num_free == 4 and ck.num_free == 1
