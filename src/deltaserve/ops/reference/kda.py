"""Naive oracles for `deltaserve.ops.kda` (spec/model.md §6).

Plain functions over ONE sequence, written as the spec's formulas with explicit token / tap /
row loops. They compute in the dtype they are given (pass float64 for a tight oracle) and are
never used in the serving path.
"""

from __future__ import annotations

import torch


def naive_kda_gate_sigmoid(f, A_log, dt_bias, lower_bound=-5.0):
    """K3 gate `lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))`, f: [T, H, K]."""
    h, k = f.shape[-2:]
    x = torch.exp(A_log.reshape(h, 1)) * (f + dt_bias.reshape(h, k))
    return lower_bound / (1.0 + torch.exp(-x))


def naive_kda_gate_softplus(f, A_log, dt_bias):
    """Kimi-Linear gate `-exp(A_log[h]) * log(1 + exp(f + dt_bias[h]))`, f: [T, H, K]."""
    h, k = f.shape[-2:]
    x = f + dt_bias.reshape(h, k)
    return -torch.exp(A_log.reshape(h, 1)) * torch.log1p(torch.exp(x))


def naive_l2_norm(x, eps=1e-6):
    """`x / sqrt(sum(x^2) + eps)` over the last dim."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def naive_causal_conv1d(x, weight, initial_tail=None):
    """One sequence. x: [T, C]; weight: [C, W]; initial_tail: [W-1, C] or None (zeros).
    `y[t] = silu(sum_j weight[:, j] * u[t-(W-1)+j])` over u = tail ++ x.
    Returns (y [T, C], final tail = last W-1 rows of u)."""
    t_len, c = x.shape
    w = weight.shape[1]
    tail = x.new_zeros(w - 1, c) if initial_tail is None else initial_tail.to(x.dtype)
    u = torch.cat([tail, x])
    y = x.new_zeros(t_len, c)
    for t in range(t_len):
        acc = x.new_zeros(c)
        for j in range(w):
            acc = acc + weight[:, j] * u[t + j]
        y[t] = acc * torch.sigmoid(acc)
    return y, u[u.shape[0] - (w - 1) :].clone()


def naive_recurrent_kda(q, k, v, g, beta, scale, initial_state=None):
    """Token loop of §6.2 for one sequence.
    q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; initial_state: [H, K, V] or None.
    Per token: S <- diag(exp(g)) S; S <- S + beta k (v - S^T k)^T; o = scale S^T q.
    Returns (o [T, H, V], final state [H, K, V])."""
    t_len, h, dk = k.shape
    dv = v.shape[-1]
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.clone()
    o = q.new_zeros(t_len, h, dv)
    for t in range(t_len):
        s = torch.exp(g[t]).unsqueeze(-1) * s
        pred = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + beta[t][:, None, None] * torch.einsum("hk,hv->hkv", k[t], v[t] - pred)
        o[t] = scale * torch.einsum("hk,hkv->hv", q[t], s)
    return o, s


def naive_chunk_kda(q, k, v, g, beta, scale, initial_state=None, chunk_size=64):
    """Chunked form of §6.3 for one sequence, as a cross-check of the math: zero-padded chunks,
    explicit exp(G_i - G_j) from differences, (I+L)^-1 by row-by-row forward substitution.
    Shapes and returns as `naive_recurrent_kda`."""
    t_len, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t_len) % c

    def padded(x):
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).transpose(0, 1)  # [H, T', ...]

    qs, ks, vs, gs, bs = padded(q * scale), padded(k), padded(v), padded(g), padded(beta)
    s = q.new_zeros(h, dk, dv) if initial_state is None else initial_state.clone()
    out = []
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    for c0 in range(0, t_len + pad, c):
        qc, kc, vc = qs[:, c0 : c0 + c], ks[:, c0 : c0 + c], vs[:, c0 : c0 + c]
        gcum, bc = gs[:, c0 : c0 + c].cumsum(1), bs[:, c0 : c0 + c]
        upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)[None, :, :, None]
        dec = torch.exp((gcum[:, :, None, :] - gcum[:, None, :, :]).masked_fill(upper, -torch.inf))
        lmat = bc[:, :, None] * torch.einsum("hid,hjd,hijd->hij", kc, kc, dec).tril(-1)
        a_qk = torch.einsum("hid,hjd,hijd->hij", qc, kc, dec).tril(0)
        inv = torch.zeros_like(lmat)  # (I + L)^-1
        for i in range(c):
            row = eye[i].expand(h, c).clone()
            for j in range(i):
                row = row - lmat[:, i, j, None] * inv[:, j]
            inv[:, i] = row
        m = inv * bc[:, None, :]
        w = m @ (torch.exp(gcum) * kc)
        u = m @ vc
        delta = u - w @ s
        out.append(torch.exp(gcum) * qc @ s + a_qk @ delta)
        g_last = gcum[:, -1:]
        k_dec = (kc * torch.exp(g_last - gcum)).transpose(1, 2)
        s = torch.exp(g_last).transpose(1, 2) * s + k_dec @ delta
    return torch.cat(out, 1).transpose(0, 1)[:t_len], s
