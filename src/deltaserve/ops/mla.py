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
    n = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1, device=q.device),
                                  cu_seqlens.diff())
    pos = torch.arange(n, device=q.device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])     # [N, N]
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, v.float()).to(q.dtype)


def mla_absorbed_attention(q_latent: torch.Tensor, kv_latent: torch.Tensor,
                           cu_q: torch.Tensor, cu_kv: torch.Tensor, kv_lora_rank: int,
                           scale: float) -> torch.Tensor:
    """Absorbed (MQA over the latent) attention of new queries over each sequence's context.
    q_latent: [Nq, H, R + Dr] = [W_UK^T q_nope | q_rot] per head; kv_latent: [Nkv, R + Dr]
    latent rows of every sequence's full context (cached + new), packed by cu_kv.
    Query i of sequence b (of n_b queries, c_b context rows) sits at position c_b - n_b + i and
    sees context rows [0, c_b - n_b + i]. Keys are the full rows, values the first R columns.
    Returns the latent outputs [Nq, H, R] in q_latent's dtype (softmax in fp32)."""
    dev = q_latent.device
    nq_per, nkv_per = cu_q.diff(), cu_kv.diff()
    q_seq = torch.repeat_interleave(torch.arange(nq_per.numel(), device=dev), nq_per)
    kv_seq = torch.repeat_interleave(torch.arange(nkv_per.numel(), device=dev), nkv_per)
    q_pos = torch.arange(q_latent.shape[0], device=dev) - cu_q[q_seq] + (nkv_per - nq_per)[q_seq]
    kv_pos = torch.arange(kv_latent.shape[0], device=dev) - cu_kv[kv_seq]
    allowed = (q_seq[:, None] == kv_seq[None, :]) & (kv_pos[None, :] <= q_pos[:, None])
    scores = torch.einsum("nhc,mc->hnm", q_latent.float(), kv_latent.float()) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnm,mr->nhr", probs, kv_latent[:, :kv_lora_rank].float()).to(q_latent.dtype)
