"""Routed experts under wide expert parallelism: dispatch by all-to-all, run the local experts,
combine by all-to-all (DeepEP-style, in pure PyTorch collectives).

Rank r of W holds the contiguous experts [r L, (r + 1) L), L = E / W. A step on rank r:
1. its (token, slot) pairs are sorted by expert (stable), so each destination rank's rows are one
   contiguous run, its experts' rows in expert order within it;
2. the per-expert pair counts are exchanged first (an equal-split all-to-all of W x L counts), so
   every rank knows how many rows each source sends to each of its experts (variable splits);
3. the rows go out (`all_to_all_single`, variable splits), each rank runs `run_local(rows,
   local ids)` once over all it received, and the outputs go back the same way reversed;
4. the sender puts each output back at its pair and sums the k slots in fp32 in slot order, as
   `ops.moe.grouped_experts` does, so the result equals the dense MoE's up to GEMM blocking.

No Python loop over experts or ranks: sorting, counts and segment ids are batched tensor ops. A
rank with zero tokens takes part all the same (empty sends), which is how an idle data-parallel
replica keeps the collectives in step.

Tensor parallelism inside a replica (TP T, W = D x T): after attention's all-reduce every TP rank
of a replica holds the same N hidden rows, so the MoE input is replicated there. Each TP rank
routes and dispatches only its `share` of them (ceil(N / T) rows, the last ranks fewer or none)
and the replica all-gathers the combined outputs (`gather_shares`). Chosen over "TP rank 0
dispatches everything": every rank sends and receives about 1/T of the replica's rows instead of
rank 0 all of them, routing is not repeated T times, and the exchange stays one group of all W
ranks with no TP-rank-0-only step; the extra cost is one all-gather of N routed rows inside the
replica (which plain TP's all-reduce of the routed sum costs anyway). A replica's TP ranks agree
on N, so a rank with an empty share still exchanges (empty) and all of them skip the gather at N 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Exchange = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
"""(rows, out_splits, in_splits) -> rows received: an all-to-all over the W ranks."""


@dataclass(frozen=True)
class Dispatch:
    """One rank's routing, sorted: `order` the flat (token * k + slot) pairs by expert, `send`
    [W, L] its pair count per destination rank and local expert."""

    order: torch.Tensor
    send: torch.Tensor
    k: int

    @property
    def in_splits(self) -> list[int]:
        return self.send.sum(1).tolist()


def plan_dispatch(ids: torch.Tensor, num_experts: int, world: int) -> Dispatch:
    """Sort the router's `ids` [N, k] by expert; counts per (rank, local expert)."""
    if num_experts % world:
        raise ValueError(f"wide expert parallelism: {num_experts} routed experts do not split over {world} ranks")
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    send = torch.bincount(flat, minlength=num_experts).view(world, num_experts // world)
    return Dispatch(order, send, ids.shape[1])


def received_ids(recv: torch.Tensor) -> torch.Tensor:
    """The local expert of each received row: rows come by source rank, then by local expert,
    `recv` [W, L] of them each."""
    world, local = recv.shape
    experts = torch.arange(local, device=recv.device).repeat(world)
    return torch.repeat_interleave(experts, recv.reshape(-1))


def combine(back: torch.Tensor, d: Dispatch, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The expert outputs `back` (in `d.order`) put back at their pairs and summed over the slots
    in fp32, slot 0 first (the dense op's order), weighted by the router's `weights` [N, k]."""
    n, k = weights.shape
    ys = back.new_empty(n * k, back.shape[1])
    ys[d.order] = back
    acc = torch.promote_types(dtype, torch.float32)
    ys = ys.view(n, k, back.shape[1])
    w = weights.to(acc)
    out = w[:, 0, None] * ys[:, 0].to(acc)
    for j in range(1, k):
        out = out + w[:, j, None] * ys[:, j].to(acc)
    return out.to(dtype)


def share(n: int, world: int, rank: int) -> slice:
    """TP rank `rank`'s rows of `n` replicated ones: ceil(n / world) each in rank order, the last
    ranks fewer (possibly none)."""
    per = -(-n // world)
    lo = min(n, rank * per)
    return slice(lo, min(n, lo + per))


def gather_shares(y: torch.Tensor, n: int, world: int, all_gather: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Every TP rank's `y` (its `share` of `n` rows) concatenated back into the `n` rows:
    `all_gather(x, dim)` over the replica's TP group of `y` zero-padded to ceil(n / world) rows
    (equal sizes), the padding dropped. No collective at n 0 (every TP rank of a replica has the
    same n)."""
    if n == 0:
        return y
    per = -(-n // world)
    padded = y.new_zeros(per, *y.shape[1:])
    padded[: y.shape[0]] = y
    return all_gather(padded, 0)[:n]


def a2a_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    world: int,
    exchange: Exchange,
    run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe.grouped_experts` over experts spread on `world` ranks: x [N, Din], router `ids`,
    `weights` [N, k] (global ids). `run_local(rows, local_ids)` returns each row's own expert output
    (unweighted, x's dtype). Returns (output [N, Dout] in x's dtype, tokens each local expert
    received [L] this call). Every rank must call it the same number of times, N = 0 included."""
    d = plan_dispatch(ids, num_experts, world)
    recv = exchange(d.send.reshape(-1), [d.send.shape[1]] * world, [d.send.shape[1]] * world).view(d.send.shape)
    out_splits, in_splits = recv.sum(1).tolist(), d.in_splits
    rows = exchange(x[d.order // d.k], out_splits, in_splits)
    ys = run_local(rows, received_ids(recv)).to(x.dtype)
    back = exchange(ys, in_splits, out_splits)
    return combine(back, d, weights, x.dtype), recv.sum(0)
