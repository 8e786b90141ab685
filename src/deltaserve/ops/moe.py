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
    raise NotImplementedError


def grouped_experts(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                    w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Routed experts, grouped by expert (tokens sorted by expert, one GEMM per active expert).
    x: [N, Din]; expert_ids, weights: [N, k]; w1 (gate), w3 (up): [E, I, Din]; w2: [E, Din, I].
    y_{n,j} = x.dtype( w2_e @ act(w1_e x_n, w3_e x_n) ); returns x.dtype( sum_j w[n,j] * y_{n,j} )
    with the weighted sum in fp32 (the upstream rounding order)."""
    raise NotImplementedError
