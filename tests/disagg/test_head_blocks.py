"""Head blocks re-slice the KDA state between instances of other tensor-parallel sizes: a
rank's block b holds the same bytes as the whole-model state's heads of that block (the conv
tail's q, k and v channel runs and the recurrent state), so digests keyed by (layer, block)
agree across sizes, and `plan_reads` (executed here as plain memory copies) rebuilds a TP1 slot
from two TP2 ranks and TP2 ranks' slots from one TP1 rank, byte for byte."""

from __future__ import annotations

import ctypes

import pytest
import torch

from deltaserve.cache.handoff import kda_regions, pool_tensors, region_digests
from deltaserve.cache.kda_pool import KdaStatePool
from deltaserve.cache.mla_pool import MlaPagePool
from deltaserve.disagg.plan import head_blocks, plan_reads
from deltaserve.disagg.protocol import RankSource, TransferHeader
from deltaserve.engine.exec.rank_transfer import spans

H, K, W1, LAYERS, SLOTS = 4, 2, 3, 2, 3


def whole(seed: int) -> KdaStatePool:
    pool = KdaStatePool([0, 1], SLOTS, (W1, 3 * H * K), (H, K, K), torch.float32)
    g = torch.Generator().manual_seed(seed)
    pool.tails.copy_(torch.randn(pool.tails.shape, generator=g))
    pool.states.copy_(torch.randn(pool.states.shape, generator=g))
    return pool


def rank_share(full: KdaStatePool, rank: int, world: int) -> KdaStatePool:
    """What rank `rank` of `world` holds of `full` (q, k, v channels and heads split in order)."""
    h, p = H // world, H * K // world
    pool = KdaStatePool([0, 1], SLOTS, (W1, 3 * p), (h, K, K), torch.float32)
    for q in range(3):
        pool.tails[..., q * p : (q + 1) * p] = full.tails[..., q * H * K + rank * p : q * H * K + (rank + 1) * p]
    pool.states.copy_(full.states[:, :, rank * h : (rank + 1) * h])
    return pool


def tensors(kda: KdaStatePool) -> dict:
    return pool_tensors(MlaPagePool([0], 1, 4, 8, torch.float32), kda)


def header(ranks: list[KdaStatePool], slot: int, decode_world: int) -> TransferHeader:
    blocks = head_blocks(len(ranks), decode_world) // len(ranks)
    regions = spans(kda_regions(ranks[0], slot, blocks))
    sources = []
    for r, pool in enumerate(ranks):
        t = tensors(pool)
        sources.append(RankSource(f"r{r}", {k: v.data_ptr() for k, v in t.items()}, region_digests(t, [], 0)))
    return TransferHeader("h", "t", 1, "", 0, 0, "", sources, regions, blocks)


def run(plan, local: list[KdaStatePool]) -> int:
    moved = 0
    for rank, reads in enumerate(plan.reads):
        t = tensors(local[rank])
        for rd in reads:
            for (addr, n), (name, _, off, length, _) in zip(rd.remote, rd.regions):
                assert n == length
                ctypes.memmove(t[name].data_ptr() + off, addr, n)
                moved += n
    return moved


@pytest.mark.parametrize("blocks", [2, 4])
def test_block_digests_agree_across_sizes(blocks):
    full = whole(1)
    one = region_digests(tensors(full), kda_regions(full, 1, blocks))
    shares = [rank_share(full, r, 2) for r in range(2)]
    two = {}
    for r, pool in enumerate(shares):
        two |= region_digests(tensors(pool), kda_regions(pool, 1, blocks // 2), r * blocks // 2)
    assert one == two and len(one) == LAYERS * blocks


@pytest.mark.parametrize("prefill_world, decode_world", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_plan_reads_rebuild_the_state_across_sizes(prefill_world, decode_world):
    full = whole(2)
    sources = [rank_share(full, r, prefill_world) for r in range(prefill_world)]
    h = header(sources, 1, decode_world)
    empty = whole(3)
    empty.tails.zero_()
    empty.states.zero_()
    targets = [rank_share(empty, r, decode_world) for r in range(decode_world)]
    plan = plan_reads(h, [], targets[0], 2, decode_world)
    assert plan.blocks == head_blocks(prefill_world, decode_world) // decode_world
    assert run(plan, targets) == LAYERS * (W1 * 3 * H * K + H * K * K) * 4  # every byte once
    for r, pool in enumerate(targets):
        want = rank_share(full, r, decode_world)
        assert torch.equal(pool.tails[:, 2], want.tails[:, 1]) and torch.equal(pool.states[:, 2], want.states[:, 1])
    for rank, reads in enumerate(plan.reads):  # each rank reads from the prefill ranks holding its heads
        lo, hi = rank * prefill_world // decode_world, -(-(rank + 1) * prefill_world // decode_world)
        assert [rd.session for rd in reads] == [f"r{s}" for s in range(lo, max(hi, lo + 1))]


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        kda_regions(whole(1), 0, 3)
