"""Pools, sizing and the per-step paged view, against exact expectations and `DenseCache`."""

import pytest
import torch

from deltaserve.cache import (
    CacheManager,
    ForwardBatch,
    KdaStatePool,
    MlaPagePool,
    OutOfPages,
    OutOfSlots,
    build_pools,
    plan_layout,
)
from deltaserve.model import load_model
from deltaserve.model.context import DenseCache
from deltaserve.tiny import make_tiny


def test_page_pool_refcounts_and_integrity():
    pool = MlaPagePool([3, 4], num_pages=5, page_size=4, row_dim=6, dtype=torch.float32)
    a = pool.allocate(3)
    assert pool.num_free == 2 and len(set(a)) == 3
    with pytest.raises(OutOfPages):
        pool.allocate(3)
    assert pool.num_free == 2, "a failed allocation takes nothing"
    pool.incref(a[:1])
    pool.check_integrity({a[0]: 2, a[1]: 1, a[2]: 1})
    with pytest.raises(AssertionError):
        pool.check_integrity({a[0]: 1, a[1]: 1, a[2]: 1})
    pool.release(a)
    assert pool.num_free == 4
    pool.release(a[:1])
    pool.check_integrity({})
    with pytest.raises(RuntimeError):
        pool.release(a[:1])
    assert pool.rows(4).shape == (20, 6) and pool.rows(4).data_ptr() == pool.storage[1].data_ptr()


def test_slot_pool_zeroes_on_allocate_and_round_trips():
    pool = KdaStatePool(
        [0, 2],
        num_slots=2,
        tail_shape=(3, 12),
        state_shape=(2, 4, 4),
        tail_dtype=torch.bfloat16,
        state_dtype=torch.bfloat16,
    )
    s = pool.allocate()
    slots = torch.tensor([s])
    tail, state = torch.randn(1, 3, 12), torch.randn(1, 2, 4, 4)
    pool.write(2, slots, tail, state)
    t2, st2 = pool.read(2, slots)
    assert st2.dtype == torch.float32 and torch.equal(st2, state.bfloat16().float())
    assert torch.equal(t2, tail.bfloat16())
    assert pool.read(0, slots)[1].abs().max() == 0
    pool.release(s)
    s2, s3 = pool.allocate(), pool.allocate()
    with pytest.raises(OutOfSlots):
        pool.allocate()
    for slot in (s2, s3):
        assert pool.read(2, torch.tensor([slot]))[1].abs().max() == 0, "reused slots start from zeros"
    pool.check_integrity({s2: 1, s3: 1})
    with pytest.raises(AssertionError):
        pool.check_integrity({s2: 1})


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    out = make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=5)
    return load_model(out, dtype=torch.float32, progress=False)


def test_plan_layout_budget_split_and_errors(k3):
    cfg = k3.config
    small = plan_layout(cfg, 10**7, max_num_seqs=4, max_model_len=64, page_size=16, kv_dtype=torch.bfloat16)
    assert small.total_bytes <= 10**7 < small.total_bytes + small.page_bytes
    tail_elems = (cfg.kda.conv_kernel - 1) * 3 * cfg.kda.proj_dim
    state_elems = cfg.kda.num_heads * cfg.kda.head_dim**2
    assert small.slot_bytes == len(cfg.kda_layer_ids) * (2 * tail_elems + 4 * state_elems)
    assert small.page_bytes == len(cfg.mla_layer_ids) * 16 * cfg.mla.latent_dim * 2
    assert small.num_slots == 4
    with pytest.raises(ValueError, match="max_model_len"):
        plan_layout(cfg, 4 * small.slot_bytes + 3 * small.page_bytes, 4, 64, 16, torch.bfloat16)


def test_manager_admit_grow_free(k3):
    layout = plan_layout(k3.config, 10**6, 2, 16, 4, torch.float32)
    mgr = CacheManager(*build_pools(k3.config, layout))
    assert mgr.admit(7, 5) and len(mgr.seqs[7].pages) == 2
    assert mgr.grow(7, 8) and len(mgr.seqs[7].pages) == 2
    assert mgr.grow(7, 9) and len(mgr.seqs[7].pages) == 3
    assert not mgr.grow(7, 4 * (layout.num_pages + 1)), "short pool: nothing taken"
    assert len(mgr.seqs[7].pages) == 3
    assert mgr.admit(8, 1) and not mgr.admit(9, 1), "only two slots"
    mgr.check_integrity()
    mgr.free(7), mgr.free(8)
    mgr.check_integrity()
    assert mgr.usage()["mla_pages_used"] == 0 and mgr.usage()["kda_slots_used"] == 0


@torch.inference_mode()
def test_paged_batch_equals_dense_cache(k3):
    """Two sequences stepped through odd chunks, with scattered page tables: hidden states of the
    paged view equal those of the contiguous `DenseCache` bit for bit in the KDA/MLA math."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, k3.config.vocab_size, (n,), generator=g) for n in (23, 9))
    chunks = [(7, 5), (9, 1), (1, 1), (6, 2)]
    layout = plan_layout(k3.config, 10**6, 2, 64, 4, torch.float32)
    mgr = CacheManager(*build_pools(k3.config, layout))
    mgr.admit(0, 1), mgr.admit(1, 1)
    mgr.mla.allocate(3)
    dense = DenseCache(2)
    done = [0, 0]
    for na, nb in chunks:
        ids = torch.cat([a[done[0] : done[0] + na], b[done[1] : done[1] + nb]])
        want = k3(ids, dense.begin([na, nb]))
        dense.end()
        for s, n in ((0, na), (1, nb)):
            assert mgr.grow(s, done[s] + n)
        fb = ForwardBatch(
            ids,
            list(done),
            [na, nb],
            [mgr.seqs[0].pages, mgr.seqs[1].pages],
            [mgr.seqs[0].slot, mgr.seqs[1].slot],
            mgr.mla,
            mgr.kda,
        )
        got = k3(ids, fb.context())
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        done = [done[0] + na, done[1] + nb]
    assert done == [23, 9]


@pytest.mark.parametrize("plain", [True, False])
def test_flat_rows_plain_and_numpy_equal_the_page_walk(monkeypatch, plain):
    """`_flat_rows` by list comprehension (few rows) and by numpy (many): both the row of every
    position by its page table, against a loop over positions."""
    from deltaserve.cache import forward_batch as fbm

    monkeypatch.setattr(fbm, "_PYTHON_ROWS", 10**9 if plain else 0)
    g = torch.Generator().manual_seed(1)
    size = 4
    pages = [torch.randperm(50, generator=g)[: int(n)].tolist() for n in (3, 1, 7, 5)]
    ends = [len(p) * size - int(k) for p, k in zip(pages, (1, 0, 3, 2))]
    starts = [0, ends[1] - 1, 9, ends[3]]  # whole, one (decode), a chunk, none
    want = [p[t // size] * size + t % size for p, s, e in zip(pages, starts, ends) for t in range(s, e)]
    got = fbm._flat_rows(pages, fbm._page_table(pages), starts, ends, size)
    assert got.dtype == torch.long and got.tolist() == want


@pytest.mark.parametrize("plain", [True, False])
def test_flat_rows_of_one_shared_page_list_equal_the_page_walk(monkeypatch, plain):
    """A verify's chained rows share one page list (nested contexts 0..c+i): the table and the rows
    by prefixes of the longest context, as the page walk gives them; writes (starts > 0) too."""
    from deltaserve.cache import forward_batch as fbm

    monkeypatch.setattr(fbm, "_PYTHON_ROWS", 10**9 if plain else 0)
    size, shared = 4, torch.randperm(40, generator=torch.Generator().manual_seed(2))[:9].tolist()
    pages = [shared] * 5
    table = fbm._page_table(pages)
    assert table.tolist() == [shared] * 5
    for starts, ends in (
        ([0] * 5, [27 + i for i in range(5)]),
        ([27 + i for i in range(5)], [28 + i for i in range(5)]),
    ):
        want = [shared[t // size] * size + t % size for s, e in zip(starts, ends) for t in range(s, e)]
        assert fbm._flat_rows(pages, table, starts, ends, size).tolist() == want


def test_layer_views_are_made_once_and_alias_the_pools():
    kda = KdaStatePool([1, 3], 2, (2, 6), (2, 4, 4), torch.bfloat16)
    mla = MlaPagePool([0, 2], 3, 4, 5, torch.bfloat16)
    tails, states = kda.layer_view(3)
    assert kda.layer_view(3)[0] is tails and mla.rows(2) is mla.rows(2)
    states[1].fill_(2.0)
    mla.rows(2)[7].fill_(1.0)
    assert kda.states[1, 1].eq(2.0).all() and kda.states[0].eq(0).all()
    assert mla.storage[1].view(-1, 5)[7].eq(1.0).all() and mla.storage[0].eq(0).all()
