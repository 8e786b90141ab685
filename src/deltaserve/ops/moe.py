"""MoE routing and grouped expert execution (spec/model.md §8-9)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    bias_in_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router. logits = x.float() @ gate_weight.float().T; s = sigmoid(logits);
    experts chosen by s + correction_bias (groups scored by the sum of their top-2, keeping
    topk_group groups, when num_expert_group > 1); weights are the UNBIASED s at the chosen
    experts (bias_in_weights=True reproduces Moonshot's remote-code Kimi-Linear gate, whose
    weights are the biased scores); then w / (sum w + 1e-20) if renormalize, times the scale.
    Returns (weights fp32 [N, top_k], expert ids int64 [N, top_k]).

    Masked groups are set to -inf before the top-k. Ids come in descending order of the biased
    score. float64 inputs are routed in float64 (and return float64 weights)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    scores = torch.sigmoid(x.to(acc) @ gate_weight.to(acc).T)  # [N, E]
    pick = scores if correction_bias is None else scores + correction_bias.to(acc)
    choose = pick
    if num_expert_group > 1:
        n, e = pick.shape
        per = e // num_expert_group
        grouped = pick.view(n, num_expert_group, per)
        group_score = grouped.topk(min(2, per), dim=-1).values.sum(-1)  # [N, G]
        keep = group_score.topk(topk_group, dim=-1).indices
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        choose = grouped.masked_fill(~kept[..., None], float("-inf")).view(n, e)
    ids = choose.topk(top_k, dim=-1).indices
    weights = (pick if bias_in_weights else scores).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """Routed experts, grouped by expert (tokens sorted by expert, one GEMM per active expert).
    x: [N, Din]; expert_ids, weights: [N, k]; w1 (gate), w3 (up): [E, I, Din]; w2: [E, Din, I].
    y_{n,j} = x.dtype( w2_e @ act(w1_e x_n, w3_e x_n) ); returns x.dtype( sum_j w[n,j] * y_{n,j} )
    with the weighted sum in fp32 (the upstream rounding order); `linear(x, w)` is the backend's.

    The fp32 sum runs over slots j = 0..k-1 in order (what torch's `sum(dim=1)` in upstream's
    `moe_infer` does at the model widths). Expert weights of another dtype are cast to x's
    per expert. Working set: the [N * k, Din] expert outputs in x's dtype."""
    n, k = expert_ids.shape
    d_out = w2.shape[1]
    if n == 0 or k == 0:
        return x.new_zeros(n, d_out)
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    counts = torch.bincount(flat, minlength=w1.shape[0])
    ends = torch.cumsum(counts, 0).tolist()
    sizes = counts.tolist()
    ys = x.new_empty(n * k, d_out)
    for e in torch.nonzero(counts).flatten().tolist():
        rows = slice(ends[e] - sizes[e], ends[e])
        xe = x[tokens[rows]]
        h = act(linear(xe, w1[e].to(x.dtype)), linear(xe, w3[e].to(x.dtype)))
        ys[order[rows]] = linear(h.to(x.dtype), w2[e].to(x.dtype)).to(x.dtype)
    acc = torch.promote_types(x.dtype, torch.float32)
    ys = ys.view(n, k, d_out)
    w = weights.to(acc)
    out = w[:, 0, None] * ys[:, 0].to(acc)
    for j in range(1, k):
        out = out + w[:, j, None] * ys[:, j].to(acc)
    return out.to(x.dtype)
