"""Wide-EP MoE (`ops.moe_a2a`): W simulated ranks (threads exchanging through a barrier, the same
code path as the gloo all-to-all) together compute the dense MoE of all their tokens: each rank's
output equals `grouped_experts` on its tokens, a rank with zero tokens included; each expert's
load is its pair count; the dispatch is sorted by expert with per-(rank, expert) counts. Inside a
replica of T TP ranks the shares of N rows partition them and their gather restores them."""

from __future__ import annotations

import threading

import pytest
import torch

from deltaserve.ops.backends.torch import REFERENCE
from deltaserve.ops.moe_a2a import a2a_experts, gather_shares, plan_dispatch, received_ids, share
from deltaserve.ops.operands import ExpertWeights, GluAct


class ThreadExchange:
    """An all-to-all between `world` threads: each posts its rows cut by `in_splits`, then takes
    the chunk every source cut for it (source order), as `all_to_all_single` does."""

    def __init__(self, world: int):
        self.world = world
        self.posted: list[list[torch.Tensor] | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.calls = [0] * world

    def of(self, rank: int):
        def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
            assert len(in_splits) == len(out_splits) == self.world and sum(in_splits) == x.shape[0]
            self.posted[rank] = list(torch.split(x, in_splits))
            self.barrier.wait()
            got = [self.posted[src][rank] for src in range(self.world)]
            self.barrier.wait()
            self.calls[rank] += 1
            assert [g.shape[0] for g in got] == out_splits
            return torch.cat(got)

        return exchange


def _experts(e: int, width: int, d: int, gen: torch.Generator) -> ExpertWeights:
    w1, w3 = (torch.randn(e, width, d, generator=gen) * 0.2 for _ in range(2))
    return ExpertWeights(w1, w3, torch.randn(e, d, width, generator=gen) * 0.2)


def _run_ranks(xs, idss, ws, ex: ExpertWeights, act: GluAct, world: int):
    """Every rank's (output, load, rows it computed) from `a2a_experts` on threads."""
    e = ex.w1.shape[0]
    local = e // world
    exchange = ThreadExchange(world)
    results: list = [None] * world
    errors: list = []

    def rank(r: int) -> None:
        computed = []

        def run_local(rows, lids):
            computed.append(rows.shape[0])
            lo = r * local
            mine = ExpertWeights(ex.w1[lo : lo + local], ex.w3[lo : lo + local], ex.w2[lo : lo + local])
            return REFERENCE.experts(rows, lids[:, None], torch.ones(rows.shape[0], 1), mine, act)

        try:
            out, load = a2a_experts(xs[r], idss[r], ws[r], e, world, exchange.of(r), run_local)
            results[r] = (out, load, sum(computed))
        except BaseException as err:  # surfaced below, with the barrier broken for the others
            errors.append(err)
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert exchange.calls == [3] * world  # counts, rows out, rows back: whatever the rank's tokens
    return results


@pytest.mark.parametrize("world,tokens", [(2, (7, 0)), (4, (5, 1, 0, 9)), (1, (6,))])
def test_a2a_experts_equal_the_dense_moe(world, tokens):
    gen = torch.Generator().manual_seed(world)
    e, k, width, d = 8, 3, 16, 12
    ex, act = _experts(e, width, d, gen), GluAct("silu")
    xs = [torch.randn(n, d, generator=gen) for n in tokens]
    idss = [torch.rand(n, e, generator=gen).argsort(-1)[:, :k] for n in tokens]  # k distinct experts a token
    ws = [torch.rand(n, k, generator=gen) for n in tokens]
    results = _run_ranks(xs, idss, ws, ex, act, world)
    local = e // world
    every = torch.cat(idss).reshape(-1)
    for r, (out, load, computed) in enumerate(results):
        want = REFERENCE.experts(xs[r], idss[r], ws[r], ex, act)
        assert out.shape == (tokens[r], d) and out.dtype == xs[r].dtype
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        mine = (every >= r * local) & (every < (r + 1) * local)
        assert computed == mine.sum().item()  # each pair computed once, on its expert's rank
        assert torch.equal(load, torch.bincount(every, minlength=e)[r * local : (r + 1) * local])


def test_dispatch_sorts_by_expert_and_counts_per_rank():
    ids = torch.tensor([[3, 0], [1, 3], [2, 0]])
    d = plan_dispatch(ids, 4, 2)
    assert ids.reshape(-1)[d.order].tolist() == [0, 0, 1, 2, 3, 3]
    assert d.order.tolist() == [1, 5, 2, 4, 0, 3]  # stable: ties keep pair order
    assert d.send.tolist() == [[2, 1], [1, 2]] and d.in_splits == [3, 3]
    assert received_ids(torch.tensor([[2, 0], [1, 3]])).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="6 routed experts do not split over 4 ranks"):
        plan_dispatch(ids, 6, 4)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_tp_shares_partition_the_rows_and_gather_back(world):
    for n in range(0, 11):
        x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
        parts = [x[share(n, world, r)] for r in range(world)]
        assert torch.equal(torch.cat(parts), x) and max(p.shape[0] for p in parts) == -(-n // world)
        calls = []

        def all_gather(padded: torch.Tensor, dim: int) -> torch.Tensor:
            calls.append(padded.shape[0])  # every rank pads to the same size
            return torch.cat([torch.cat([p, p.new_zeros(padded.shape[0] - p.shape[0], 3)]) for p in parts], dim)

        for r in range(world):
            assert torch.equal(gather_shares(parts[r], n, world, all_gather), x)
        assert calls == ([] if n == 0 else [-(-n // world)] * world)  # no collective at n 0
