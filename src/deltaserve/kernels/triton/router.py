"""Triton grouped top-k routing (`ops.moe.route` after the router GEMM), one program per token.

From the fp32 router logits: s = sigmoid(logits), pick = s + bias; when grouped, each group is
scored by the sum of its two best `pick` values and the `topk_group` best groups stay, the others
are masked to -inf; then `top_k` rounds of arg-max (ids in descending order of `pick`, the lowest id
on ties), weights = s (or pick) at the chosen ids, renormalised with +1e-20, times the scale.
Callers must keep `top_k <= topk_group * (E / num_expert_group)` (no -inf expert is ever chosen).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits,
    bias,
    w_out,
    id_out,
    stride_l,
    G,
    PER,
    topk_group,
    scale,
    TOP_K: tl.constexpr,
    G_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    TOP2: tl.constexpr,
    BIAS_IN_W: tl.constexpr,
    RENORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)
    p = tl.arange(0, P_PAD)
    valid = (g[:, None] < G) & (p[None, :] < PER)
    eid = g[:, None] * PER + p[None, :]
    s = tl.sigmoid(tl.load(logits + row * stride_l + eid, mask=valid, other=0.0))
    pick = s
    if HAS_BIAS:
        pick = s + tl.load(bias + eid, mask=valid, other=0.0)
    neg = float("-inf")
    choose = tl.where(valid, pick, neg)
    if GROUPED:
        best = tl.max(choose, 1)
        score = best
        if TOP2:
            first = tl.min(tl.where(choose == best[:, None], p[None, :], P_PAD), 1)
            score = best + tl.max(tl.where(p[None, :] == first[:, None], neg, choose), 1)
        score = tl.where(g < G, score, neg)
        kept = tl.zeros([G_PAD], tl.int32)
        for _ in range(topk_group):
            top = tl.max(score, 0)
            gi = tl.min(tl.where(score == top, g, G_PAD), 0)
            kept = tl.where(g == gi, 1, kept)
            score = tl.where(g == gi, neg, score)
        choose = tl.where(kept[:, None] != 0, choose, neg)
    source = pick if BIAS_IN_W else s
    slot = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    big = G_PAD * P_PAD
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.max(choose, 1), 0)
        sel = tl.min(tl.min(tl.where(choose == top, eid, big), 1), 0)
        hit = eid == sel
        wj = tl.sum(tl.sum(tl.where(hit, source, 0.0), 1), 0)
        weights = tl.where(slot == j, wj, weights)
        ids = tl.where(slot == j, sel, ids)
        choose = tl.where(hit, neg, choose)
    if RENORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    kmask = slot < TOP_K
    tl.store(w_out + row * TOP_K + slot, weights * scale, mask=kmask)
    tl.store(id_out + row * TOP_K + slot, ids.to(tl.int64), mask=kmask)


def route_select(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
    bias_in_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [N, E] -> (weights fp32 [N, top_k], ids int64 [N, top_k])."""
    n, e = logits.shape
    groups = max(num_expert_group, 1)
    per = e // groups
    logits = logits.contiguous()
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits,
            bias.float().contiguous() if bias is not None else logits,
            weights,
            ids,
            logits.stride(0),
            groups,
            per,
            topk_group,
            float(routed_scaling_factor),
            TOP_K=top_k,
            G_PAD=triton.next_power_of_2(groups),
            P_PAD=triton.next_power_of_2(per),
            K_PAD=triton.next_power_of_2(top_k),
            HAS_BIAS=bias is not None,
            GROUPED=groups > 1,
            TOP2=per > 1,
            BIAS_IN_W=bias_in_weights,
            RENORM=renormalize,
        )
    return weights, ids
