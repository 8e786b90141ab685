"""Kimi Delta Attention ops (spec/model.md §6): gates, short causal conv, chunked prefill
(WY/UT form, chunk 64) and the recurrent decode step, over packed varlen batches.

Conventions shared by every function here:
- packed tokens: tensors are `[N, ...]` with `cu_seqlens` (int64 `[B+1]`, cu[0] = 0, cu[B] = N);
- q and k arrive already L2-normalised, `g` is the per-key-channel log-decay (fp32, <= 0),
  `beta` is post-sigmoid (fp32); all math runs in fp32 and outputs are fp32;
- the recurrent state is `[B, H, K, V]` (key rows, value columns), fp32;
- the conv tail holds the last `W-1` PRE-conv inputs of each sequence, `[B, W-1, C]`.
"""
from __future__ import annotations

import torch


def kda_gate_sigmoid(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     lower_bound: float = -5.0) -> torch.Tensor:
    """K3 gate: `g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))`.
    f: [N, H, K]; A_log: [H] (already sliced/flattened); dt_bias: [H*K]. Returns fp32 [N, H, K]."""
    raise NotImplementedError


def kda_gate_softplus(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear gate: `g = -exp(A_log[h]) * softplus(f + dt_bias[h])`. Shapes as above."""
    raise NotImplementedError


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2, -1) + eps)` in fp32 (eps inside the sqrt). Returns fp32."""
    raise NotImplementedError


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                  initial_tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over packed sequences.
    x: [N, C] pre-conv inputs; weight: [C, W] (a checkpoint's [C, 1, W] squeezed);
    initial_tail: [B, W-1, C] (rows before each sequence's first token; zeros if None).
    `y[t, c] = silu(sum_j weight[c, j] * u[t - (W-1) + j, c])`.
    Returns (y fp32 [N, C], final_tail [B, W-1, C] in x's dtype: the last W-1 inputs of each
    sequence, taking rows from initial_tail when a sequence is shorter than W-1)."""
    raise NotImplementedError


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor,
                       tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence. x: [B, C]; tail: [B, W-1, C].
    Returns (y fp32 [B, C], new_tail [B, W-1, C]) where new_tail = tail[:, 1:] ++ x."""
    raise NotImplementedError


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                initial_state: torch.Tensor | None = None, chunk_size: int = 64,
                export_offsets: list[list[int]] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked KDA prefill over packed sequences.
    q, k, g: [N, H, K]; v: [N, H, V]; beta: [N, H]; initial_state: [B, H, K, V] or None (zeros).
    export_offsets[b]: sorted token offsets `0 < o <= len_b` (relative to sequence b's start)
    at which to also return the state after token o-1; any offsets, not only chunk multiples,
    at no extra pass (chunks are cut at requested offsets).
    Returns (o fp32 [N, H, V], final_state fp32 [B, H, K, V],
             exported fp32 [sum(len(e)), H, K, V] in (sequence, offset) order, or None)."""
    raise NotImplementedError


def kda_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token per sequence, updating `state` IN PLACE.
    q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; state: fp32 [B, H, K, V].
    S <- diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = scale * S^T q.
    Returns o fp32 [B, H, V]."""
    raise NotImplementedError
