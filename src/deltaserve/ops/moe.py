"""MoE routing and grouped expert execution (spec/model.md §8-9)."""
from __future__ import annotations

from typing import Callable

import torch


def route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor | None,
          top_k: int, num_expert_group: int = 1, topk_group: int = 1, renormalize: bool = True,
          routed_scaling_factor: float = 1.0, bias_in_weights: bool = False,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router. logits = x.float() @ gate_weight.float().T; s = sigmoid(logits);
    experts chosen by s + correction_bias (groups scored by the sum of their top-2, keeping
    topk_group groups, when num_expert_group > 1); weights are the UNBIASED s at the chosen
    experts (bias_in_weights=True reproduces Moonshot's remote-code Kimi-Linear gate, whose
    weights are the biased scores); then w / (sum w + 1e-20) if renormalize, times the scale.
    Returns (weights fp32 [N, top_k], expert ids int64 [N, top_k])."""
    scores = torch.sigmoid(x.float() @ gate_weight.float().t())            # [N, E]
    pick = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 1:
        n, e = pick.shape
        grouped = pick.view(n, num_expert_group, e // num_expert_group)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        pick = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)
    ids = pick.topk(top_k, dim=-1).indices
    weights = (pick if bias_in_weights else scores).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def grouped_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Routed experts, grouped by expert (tokens sorted by expert, one GEMM per active expert).
    x: [N, Din]; expert_ids, weights: [N, k]; w1 (gate), w3 (up): [E, I, Din]; w2: [E, Din, I].
    y_{n,j} = x.dtype( w2_e @ act(w1_e x_n, w3_e x_n) ); returns x.dtype( sum_j w[n,j] * y_{n,j} )
    with the weighted sum in fp32 (the upstream rounding order)."""
    n, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    tokens = order // k
    out = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start:start + c]
        xs = x[tokens[start:start + c]]
        y = torch.nn.functional.linear(act(torch.nn.functional.linear(xs, w1[e]),
                                           torch.nn.functional.linear(xs, w3[e])), w2[e]).to(x.dtype)
        out.index_add_(0, tokens[start:start + c], y.float() * weights.reshape(-1)[sel, None].float())
        start += c
    return out.to(x.dtype)
