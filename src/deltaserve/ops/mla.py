"""Multi-head Latent Attention ops, NoPE (spec/model.md §7).

The latent cache row of a token is `[c_hat (kv_lora_rank) | k_rot (qk_rope_head_dim)]`,
c_hat already normalised. Nothing here is rotated: there are no positions in the text model.
"""
from __future__ import annotations

import torch


def mla_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence (unabsorbed form).
    q, k: [N, H, Dqk]; v: [N, H, Dv]; returns [N, H, Dv] in q's dtype (softmax in fp32)."""
    raise NotImplementedError


def mla_absorbed_attention(q_latent: torch.Tensor, kv_latent: torch.Tensor,
                           cu_q: torch.Tensor, cu_kv: torch.Tensor, kv_lora_rank: int,
                           scale: float) -> torch.Tensor:
    """Absorbed (MQA over the latent) attention of new queries over each sequence's context.
    q_latent: [Nq, H, R + Dr] = [W_UK^T q_nope | q_rot] per head; kv_latent: [Nkv, R + Dr]
    latent rows of every sequence's full context (cached + new), packed by cu_kv.
    Query i of sequence b (of n_b queries, c_b context rows) sits at position c_b - n_b + i and
    sees context rows [0, c_b - n_b + i]. Keys are the full rows, values the first R columns.
    Returns the latent outputs [Nq, H, R] in q_latent's dtype (softmax in fp32)."""
    raise NotImplementedError
