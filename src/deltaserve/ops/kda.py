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

import math

import torch
import torch.nn.functional as F

from ..kernels.chunking import checked_cu_seqlens, chunk_plan
from ..kernels.chunking import excl_cumsum as _excl_cumsum
from ..kernels.transfer import host_copy

_SLICE_ELEMS = 1 << 22  # cap on X*C*K elements of one batched intra-chunk call (memory bound)
_FLUSH = 30.0  # decay factors below exp(-30) ~ 1e-13 are flushed to exactly 0


def kda_gate_sigmoid(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0
) -> torch.Tensor:
    """K3 gate: `g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))`.
    f: [N, H, K]; A_log: [H] (already sliced/flattened); dt_bias: [H*K]. Returns fp32 [N, H, K]."""
    h, k = f.shape[-2:]
    a = A_log.float().reshape(h, 1).exp()
    return lower_bound * torch.sigmoid(a * (f.float() + dt_bias.float().view(h, k)))


def kda_gate_softplus(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear gate: `g = -exp(A_log[h]) * softplus(f + dt_bias[h])`. Shapes as above."""
    h, k = f.shape[-2:]
    a = A_log.float().reshape(h, 1).exp()
    return -a * F.softplus(f.float() + dt_bias.float().view(h, k), beta=1.0, threshold=20.0)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2, -1) + eps)` in fp32 (eps inside the sqrt). Returns fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over packed sequences.
    x: [N, C] pre-conv inputs; weight: [C, W] (a checkpoint's [C, 1, W] squeezed);
    initial_tail: [B, W-1, C] (rows before each sequence's first token; zeros if None).
    `y[t, c] = silu(sum_j weight[c, j] * u[t - (W-1) + j, c])`.
    Returns (y fp32 [N, C], final_tail [B, W-1, C] in x's dtype: the last W-1 inputs of each
    sequence, taking rows from initial_tail when a sequence is shorter than W-1)."""
    n, c = x.shape
    w = weight.shape[-1]
    p = w - 1
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    b = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    # extended stream: per sequence, its p tail rows then its tokens
    ext = x.new_zeros((n + b * p, c), dtype=torch.float32)
    seq = torch.repeat_interleave(torch.arange(b, device=x.device), lens, output_size=n)
    tok_pos = torch.arange(n, device=x.device) + (seq + 1) * p
    ext[tok_pos] = x.float()
    rows = torch.arange(p, device=x.device)
    if initial_tail is not None and p > 0:
        tail_pos = (cu[:-1] + torch.arange(b, device=x.device) * p)[:, None] + rows
        ext[tail_pos.reshape(-1)] = initial_tail.float().reshape(-1, c)
    wt = weight.float().reshape(c, w)
    acc = ext[: n + b * p - p] * wt[:, 0]
    for j in range(1, w):
        acc += ext[j : j + acc.shape[0]] * wt[:, j]
    y = F.silu(acc[tok_pos - p])
    end_pos = (cu[1:] + torch.arange(b, device=x.device) * p)[:, None] + rows
    return y, ext[end_pos].to(x.dtype)


def conv_tails_at(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_tail: torch.Tensor | None,
    export_offsets: list[list[int]],
    width: int,
) -> torch.Tensor:
    """Conv tails at interior offsets: for each (b, o) in order, the W-1 pre-conv inputs before
    token o of sequence b (`0 < o <= len_b`), reaching into `initial_tail` (or zeros) when
    o < W-1. Equals `causal_conv1d`'s final tail of the prefix of length o. x: [N, C].
    Returns [sum(len(e)), W-1, C] in x's dtype."""
    p, c = width - 1, x.shape[1]
    cu = host_copy(cu_seqlens).to(torch.long)
    seq = torch.tensor([b for b, offs in enumerate(export_offsets) for _ in offs], dtype=torch.long)
    off = torch.tensor([o for offs in export_offsets for o in offs], dtype=torch.long)
    if off.numel() == 0 or p == 0:
        return x.new_zeros(off.numel(), p, c)
    lens = cu[1:] - cu[:-1]
    if bool((off < 1).any()) or bool((off > lens[seq]).any()):
        raise ValueError("conv export offsets must lie in 1..len of their sequence")
    rel = off[:, None] - p + torch.arange(p)  # positions within the sequence
    prior = (
        torch.zeros(len(export_offsets), p, c, dtype=x.dtype, device=x.device)
        if initial_tail is None
        else initial_tail.to(x.dtype)
    )
    src = torch.cat([x, prior.reshape(-1, c)])
    idx = torch.where(rel >= 0, cu[seq][:, None] + rel, x.shape[0] + seq[:, None] * p + (rel + p))
    return src[idx.to(x.device, non_blocking=True).reshape(-1)].view(-1, p, c)


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence. x: [B, C]; tail: [B, W-1, C].
    Returns (y fp32 [B, C], new_tail [B, W-1, C]) where new_tail = tail[:, 1:] ++ x."""
    window = torch.cat([tail, x.to(tail.dtype).unsqueeze(1)], dim=1)  # [B, W, C]
    y = F.silu(torch.einsum("bwc,cw->bc", window.float(), weight.float().reshape(x.shape[1], -1)))
    return y, window[:, 1:].clone()


def _decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for log-decays x <= 0, flushing factors below exp(-_FLUSH) to zero: a flushed
    term is < 1e-13 of the undecayed terms it is summed with, and it keeps most fp32 denormals
    (10-100x slower on CPU) out of the solve and matmuls. Chunks in which every channel decays
    fast can still produce denormal W rows; torch.set_flush_denormal(True) removes that cost."""
    return x.masked_fill(x < -_FLUSH, -math.inf).exp()


def _intra_chunk(q, k, v, g, beta):
    """WY/UT intra-chunk quantities of §6.3 for a batch of chunks (q already scaled).
    q, k, g: [X, C, K] (C a power of two); v: [X, C, V]; beta: [X, C].
    Returns W, U, A_qk, Qg = q*exp(G), Kd^T = (k*exp(G_C - G))^T, eGC = exp(G_C).
    exp(G_i - G_j) is never formed as a ratio nor from a difference of cumulative sums: pairs are
    split by halving the chunk; a pair (i, j) in sibling halves factors through the boundary r
    between them, exp(G_i - G_r) * exp(G_r - G_j), where both exponents are same-sign sums of
    g inside one half, so every exponent is <= 0 and has no cancellation."""
    x_, c, kd = k.shape
    a = q.new_zeros(x_, 2, c, c)  # [:, 0] = A_qk, [:, 1] = strict K K^T part
    a[:, 0].diagonal(0, -2, -1).copy_((q * k).sum(-1))
    m = 1
    while m < c:
        p = c // (2 * m)
        gv = g.view(x_, p, 2, m, kd)
        e_row = _decay(gv[:, :, 1].cumsum(2))  # exp(G_i - G_r), i right
        e_col = _decay(_excl_cumsum(gv[:, :, 0], 2, reverse=True))  # exp(G_r - G_j), j left
        rows = torch.cat([q.view(x_, p, 2, m, kd)[:, :, 1], k.view(x_, p, 2, m, kd)[:, :, 1]], 2)
        cols = k.view(x_, p, 2, m, kd)[:, :, 0] * e_col
        cross = (rows * e_row.repeat(1, 1, 2, 1)) @ cols.transpose(-1, -2)  # [X, p, 2m, m]
        blocks = a.view(x_, 2, p, 2, m, p, 2, m).diagonal(0, 2, 5)[:, :, 1, :, 0]
        blocks.copy_(cross.view(x_, p, 2, m, m).permute(0, 2, 3, 4, 1))
        m *= 2
    lmat = a[:, 1] * beta.unsqueeze(-1)
    eg = _decay(g.cumsum(1))
    rhs = torch.cat([k * eg, v], dim=-1) * beta.unsqueeze(-1)
    sol = torch.linalg.solve_triangular(lmat, rhs, upper=False, unitriangular=True)  # (I+L)^-1
    kdt = (k * _decay(_excl_cumsum(g, 1, reverse=True))).transpose(-1, -2).contiguous()
    return sol[..., :kd], sol[..., kd:], a[:, 0], q * eg, kdt, _decay(g.sum(1))


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    export_offsets: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked KDA prefill over packed sequences.
    q, k, g: [N, H, K]; v: [N, H, V]; beta: [N, H]; initial_state: [B, H, K, V] or None (zeros).
    export_offsets[b]: sorted token offsets `0 < o <= len_b` (relative to sequence b's start)
    at which to also return the state after token o-1; any offsets, not only chunk multiples,
    at no extra pass (chunks are cut at requested offsets).
    Returns (o fp32 [N, H, V], final_state fp32 [B, H, K, V],
             exported fp32 [sum(len(e)), H, K, V] in (sequence, offset) order, or None)."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    dev = k.device
    cu = checked_cu_seqlens(cu_seqlens, n)
    nseq = cu.numel() - 1
    start, length, seq_of, pos, n_chunks, ex_chunk = chunk_plan(cu, export_offsets, chunk_size)
    nc = start.numel()
    if nc == 0:
        final = (
            torch.zeros(nseq, h, dk, dv, device=dev)
            if initial_state is None
            else initial_state.to(device=dev, dtype=torch.float32).clone()
        )
        none = None if export_offsets is None else final.new_empty(0, h, dk, dv)
        return torch.zeros(n, h, dv, device=dev), final, none
    order, perm, steps = _step_major(n_chunks, pos, seq_of, nseq)
    # chunks padded to a power of two, no wider than the longest (a verify step's few tokens, a
    # decode-sized chunk: not 64 rows of padding)
    width = 1 << (min(chunk_size, int(length.max())) - 1).bit_length()
    i = torch.arange(width)
    tok = torch.where(i < length[perm, None], start[perm, None] + i, n).reshape(-1).to(dev)

    def gather(t, d):
        t = torch.cat([t.float().reshape(n, h, d), t.new_zeros(1, h, d, dtype=torch.float32)])
        return t[tok].view(nc, width, h, d).transpose(1, 2).reshape(nc * h, width, d)

    qc, kc, vc, gc = gather(q, dk) * scale, gather(k, dk), gather(v, dv), gather(g, dk)
    bc = gather(beta, 1).squeeze(-1)
    per = max(1, _SLICE_ELEMS // (width * dk))
    parts = [
        _intra_chunk(qc[a : a + per], kc[a : a + per], vc[a : a + per], gc[a : a + per], bc[a : a + per])
        for a in range(0, nc * h, per)
    ]
    w_, u_, aqk, qg, kdt, egc = (torch.cat(p) if len(p) > 1 else p[0] for p in zip(*parts))
    del qc, kc, vc, gc, bc, parts

    if initial_state is None:
        state = torch.zeros(nseq * h, dk, dv, device=dev)
    else:
        state = initial_state.to(device=dev, dtype=torch.float32)[order.to(dev)].reshape(-1, dk, dv)
    slot, saved, inverse = _export_slots(ex_chunk, perm, state, h)
    intra = (w_, u_, aqk, qg, kdt, egc)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta)):
        out, state = _scan_autograd(state, steps, h, slot, saved, intra)
    else:
        out = _scan(state, steps, h, slot, saved, intra, width)
    state = state.view(nseq, h, dk, dv)
    final = torch.empty_like(state)
    final[order.to(dev)] = state
    o = torch.empty(n + 1, h, dv, device=dev)
    o[tok] = out.view(nc, h, width, dv).transpose(1, 2).reshape(nc * width, h, dv)
    exported = None if saved is None else saved[inverse.to(dev)]
    return o[:n], final, exported


def _step_major(n_chunks: torch.Tensor, pos: torch.Tensor, seq_of: torch.Tensor, nseq: int):
    """(order, perm, steps): step-major chunk order. Step p holds chunk p of every sequence with
    > p chunks, in the order of sequences sorted by chunk count (descending, `order`), so the
    active states form a prefix; `perm` puts the chunks in that order, `steps` counts each step's."""
    order = torch.argsort(n_chunks, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(nseq)
    perm = torch.argsort(pos * max(nseq, 1) + rank[seq_of])
    return order, perm, torch.bincount(pos).tolist()


def _export_slots(ex_chunk: torch.Tensor | None, perm: torch.Tensor, state: torch.Tensor, h: int):
    """(slot of each step-ordered chunk in `saved` (-1: none), saved [E, H, K, V] or None, the
    inverse mapping exports to saved rows or None)."""
    nc = perm.numel()
    slot = torch.full((nc,), -1, dtype=torch.long)
    if ex_chunk is None:
        return slot, None, None
    uniq, inverse = torch.unique(ex_chunk, return_inverse=True)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(nc)
    slot[inv_perm[uniq]] = torch.arange(uniq.numel())
    return slot, state.new_empty(uniq.numel(), h, *state.shape[1:]), inverse


def _scan(state, steps, h, slot, saved, intra, width):
    """The inter-chunk recurrence over the step-major chunks, `state` [B*H, K, V] updated in
    place; the states after export chunks go to `saved`. Returns out [C*H, width, V]."""
    w_, u_, aqk, qg, kdt, egc = intra
    dk, dv = state.shape[1:]
    dev = state.device
    out = torch.empty(slot.numel() * h, width, dv, device=dev)
    c0 = 0
    for na in steps:  # heads and active sequences batched; rows = chunk*H + head
        sl, s = slice(c0 * h, (c0 + na) * h), state[: na * h]
        delta = torch.baddbmm(u_[sl], w_[sl], s, alpha=-1.0)
        out[sl] = torch.baddbmm(torch.bmm(aqk[sl], delta), qg[sl], s)
        s = torch.baddbmm(egc[sl].unsqueeze(-1) * s, kdt[sl], delta)
        state[: na * h] = s
        if saved is not None:
            hit = torch.nonzero(slot[c0 : c0 + na] >= 0).squeeze(1)
            if hit.numel():
                saved[slot[c0 : c0 + na][hit].to(dev)] = s.view(na, h, dk, dv)[hit.to(dev)]
        c0 += na
    return out


def _scan_autograd(state, steps, h, slot, saved, intra):
    """`_scan` without in-place writes, for training (autograd through the recurrence): the same
    math, each step's outputs and states kept as new tensors. Returns (out, final state)."""
    w_, u_, aqk, qg, kdt, egc = intra
    dk, dv = state.shape[1:]
    outs, c0 = [], 0
    for na in steps:
        sl, s = slice(c0 * h, (c0 + na) * h), state[: na * h]
        delta = torch.baddbmm(u_[sl], w_[sl], s, alpha=-1.0)
        outs.append(torch.baddbmm(torch.bmm(aqk[sl], delta), qg[sl], s))
        s = torch.baddbmm(egc[sl].unsqueeze(-1) * s, kdt[sl], delta)
        state = torch.cat([s, state[na * h :]])
        if saved is not None:
            hit = torch.nonzero(slot[c0 : c0 + na] >= 0).squeeze(1)
            if hit.numel():
                saved[slot[c0 : c0 + na][hit].to(state.device)] = s.detach().view(na, h, dk, dv)[hit.to(state.device)]
        c0 += na
    return torch.cat(outs), state


def kda_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode token per sequence, updating `state` IN PLACE.
    q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; state: fp32 [B, H, K, V].
    S <- diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = scale * S^T q.
    Returns o fp32 [B, H, V]."""
    k = k.float()
    state.mul_(g.float().exp().unsqueeze(-1))
    kv = (k.unsqueeze(-2) @ state).squeeze(-2)
    delta = beta.float().unsqueeze(-1) * (v.float() - kv)
    if state.is_contiguous():
        dk, dv = state.shape[-2:]
        state.view(-1, dk, dv).baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    else:
        state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return scale * (q.float().unsqueeze(-2) @ state).squeeze(-2)
