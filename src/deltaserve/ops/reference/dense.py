"""Naive oracles for the dense ops: norms, activations, AttnRes, MLA, router and MoE
(spec/model.md §3, §5, §7-11).

Plain functions written as the spec's formulas, with explicit loops over sequences, heads,
tokens, slots and experts. Where the reference upcasts (norms, SiTU, router, AttnRes) they
compute in `promote(dtype, float32)`: fp32 for bf16/fp32 inputs, float64 for float64 inputs
(pass float64 for a tight oracle). Never used in the serving path.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, written out; -inf entries get weight 0."""
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


# ---------------------------------------------------------------- norms and activations (§3, §10)


def naive_rms_norm(x, weight, eps):
    """KimiRMSNorm: `w * cast_in(x / sqrt(mean(x^2) + eps))`, cast BEFORE the weight."""
    xf = x.to(_acc(x.dtype))
    normed = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def naive_gated_rms_norm(x, weight, gate, eps, out_dtype):
    """`x / sqrt(mean(x^2) + eps) * w * sigmoid(gate)`, all upcast, then cast to out_dtype."""
    acc = _acc(x.dtype)
    xf, g = x.to(acc), gate.to(acc)
    normed = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(acc) / (1.0 + torch.exp(-g))).to(out_dtype)


def naive_situ_and_mul(gate, up, beta, linear_beta):
    """SiTU(gate, up) = [beta tanh(gate/beta) sigma(gate)] * [beta_lin tanh(up/beta_lin)]."""
    acc = _acc(gate.dtype)
    g, u = gate.to(acc), up.to(acc)
    left = beta * torch.tanh(g / beta) / (1.0 + torch.exp(-g))
    right = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (left * right).to(gate.dtype)


def naive_silu_and_mul(gate, up):
    """`gate * sigma(gate) * up` in the input dtype."""
    return gate / (1.0 + torch.exp(-gate)) * up


# ---------------------------------------------------------------- Block AttnRes (§5)


def naive_attn_res_mix(cur, bank, proj, norm, eps=1e-5):
    """Mix(cur, bank, p, n): sources [*bank, cur]; score_s = rmsnorm_weightless(X_s) . (n * p);
    softmax over sources; sum of the RAW sources, accumulated in source order."""
    acc = _acc(cur.dtype)
    sources = [t.to(acc) for t in [*bank, cur]]
    q = norm.reshape(-1).to(acc) * proj.reshape(-1).to(acc)
    scores = []
    for xs in sources:
        xh = xs / torch.sqrt((xs * xs).mean(-1, keepdim=True) + eps)
        scores.append((xh * q).sum(-1))
    a = _softmax(torch.stack(scores, dim=-1))  # [N, S]
    out = torch.zeros_like(sources[0])
    for s, xs in enumerate(sources):
        out = out + a[:, s : s + 1] * xs
    return out.to(cur.dtype)


# ---------------------------------------------------------------- MLA (§7)


def _bounds(cu):
    cu = [int(v) for v in cu.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def naive_mla_prefill_attention(q, k, v, cu_seqlens, scale):
    """Per sequence, per head: softmax(q k^T * scale + causal mask) v. q, k: [N, H, Dqk]."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for a, b in _bounds(cu_seqlens):
        t = b - a
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        for h in range(q.shape[1]):
            s = (q[a:b, h] @ k[a:b, h].T) * scale
            out[a:b, h] = _softmax(s.masked_fill(future, float("-inf"))) @ v[a:b, h]
    return out


def naive_mla_absorbed_attention(q_latent, kv_latent, cu_q, cu_kv, kv_lora_rank, scale):
    """Per sequence, head and query: query i of n sits at p = c - n + i and attends rows 0..p;
    keys are the full latent rows, values their first R columns."""
    out = q_latent.new_zeros(q_latent.shape[0], q_latent.shape[1], kv_lora_rank)
    for (qa, qb), (ka, kb) in zip(_bounds(cu_q), _bounds(cu_kv)):
        n, c = qb - qa, kb - ka
        rows = kv_latent[ka:kb]
        for i in range(n):
            p = c - n + i
            for h in range(q_latent.shape[1]):
                s = (rows[: p + 1] @ q_latent[qa + i, h]) * scale
                out[qa + i, h] = _softmax(s) @ rows[: p + 1, :kv_lora_rank]
    return out


def naive_mla_project(x, kv_a, kv_a_norm, num_heads, q_proj=None, q_a=None, q_a_norm=None, q_b=None, eps=1e-6):
    """Projections of one sequence x [T, D]: (q [T, H, nope + rope], c_hat [T, R], k_rot [T, Dr]).
    q comes from q_proj (Kimi-Linear) or q_b(RMSNorm(q_a x; eps)) (K3 q-LoRA)."""
    if q_proj is not None:
        q = x @ q_proj.T
    else:
        q = naive_rms_norm(x @ q_a.T, q_a_norm, eps) @ q_b.T
    r = kv_a_norm.numel()
    kv = x @ kv_a.T
    c_hat = naive_rms_norm(kv[:, :r], kv_a_norm, eps)
    return q.view(x.shape[0], num_heads, -1), c_hat, kv[:, r:]


def _mla_out(x, o, o_proj, g_proj):
    o = o.reshape(x.shape[0], -1)
    if g_proj is not None:
        o = o / (1.0 + torch.exp(-(x @ g_proj.T)))
    return o @ o_proj.T


def naive_mla_layer_plain(
    x, kv_a, kv_a_norm, kv_b, o_proj, num_heads, q_proj=None, q_a=None, q_a_norm=None, q_b=None, g_proj=None, eps=1e-6
):
    """Spec §7.2 for one causal sequence x [T, D]: k_h = [k_nope_h ; k_rot] (k_rot shared and
    unrotated), scale (nope + rope)^-1/2, optional sigmoid gate before o_proj."""
    q, c_hat, k_rot = naive_mla_project(x, kv_a, kv_a_norm, num_heads, q_proj, q_a, q_a_norm, q_b, eps)
    t, h, dq = q.shape
    nope = dq - k_rot.shape[1]
    kvb = (c_hat @ kv_b.T).view(t, h, -1)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    o = x.new_zeros(t, h, kvb.shape[-1] - nope)
    for hh in range(h):
        k_h = torch.cat([kvb[:, hh, :nope], k_rot], dim=-1)
        s = (q[:, hh] @ k_h.T) * dq**-0.5
        o[:, hh] = _softmax(s.masked_fill(future, float("-inf"))) @ kvb[:, hh, nope:]
    return _mla_out(x, o, o_proj, g_proj)


def naive_mla_layer_absorbed(
    x, kv_a, kv_a_norm, kv_b, o_proj, num_heads, q_proj=None, q_a=None, q_a_norm=None, q_b=None, g_proj=None, eps=1e-6
):
    """Spec §7.3 for one causal sequence x [T, D]: per token t and head h,
    q_hat = W_UK_h^T q_nope_h, score(s) = (q_hat . c_hat_s + q_rot_h . k_rot_s) * scale over
    s <= t, o_h = W_UV_h (sum_s a_s c_hat_s). Same arguments as naive_mla_layer_plain."""
    q, c_hat, k_rot = naive_mla_project(x, kv_a, kv_a_norm, num_heads, q_proj, q_a, q_a_norm, q_b, eps)
    t, h, dq = q.shape
    nope = dq - k_rot.shape[1]
    w = kv_b.view(h, -1, c_hat.shape[1])
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    o = x.new_zeros(t, h, w_uv.shape[1])
    for tt in range(t):
        for hh in range(h):
            q_hat = w_uk[hh].T @ q[tt, hh, :nope]
            s = (c_hat[: tt + 1] @ q_hat + k_rot[: tt + 1] @ q[tt, hh, nope:]) * dq**-0.5
            o[tt, hh] = w_uv[hh] @ (_softmax(s) @ c_hat[: tt + 1])
    return _mla_out(x, o, o_proj, g_proj)


# ---------------------------------------------------------------- router and MoE (§8, §9, §11)


def naive_route(
    x,
    gate_weight,
    correction_bias,
    top_k,
    num_expert_group=1,
    topk_group=1,
    renormalize=True,
    routed_scaling_factor=1.0,
    bias_in_weights=False,
):
    """Per-token sigmoid router. Selection by s + bias (groups scored by the sum of their two
    best biased scores); weights s (or s + bias when bias_in_weights) at the chosen experts,
    renormalised with +1e-20, times the scale. Ids in descending order of the biased score."""
    acc = _acc(x.dtype)
    n_tok, n_exp = x.shape[0], gate_weight.shape[0]
    per = n_exp // num_expert_group
    weights = torch.zeros(n_tok, top_k, dtype=acc)
    ids = torch.zeros(n_tok, top_k, dtype=torch.int64)
    for n in range(n_tok):
        s = 1.0 / (1.0 + torch.exp(-(gate_weight.to(acc) @ x[n].to(acc))))
        pick = s if correction_bias is None else s + correction_bias.to(acc)
        allowed = list(range(n_exp))
        if num_expert_group > 1:
            group_score = [
                sorted(pick[g * per : (g + 1) * per].tolist(), reverse=True)[:2] for g in range(num_expert_group)
            ]
            keep = sorted(range(num_expert_group), key=lambda g: -sum(group_score[g]))[:topk_group]
            allowed = [e for e in allowed if e // per in keep]
        chosen = sorted(allowed, key=lambda e: -float(pick[e]))[:top_k]
        w = torch.stack([(pick if bias_in_weights else s)[e] for e in chosen])
        if renormalize:
            w = w / (w.sum() + 1e-20)
        weights[n] = w * routed_scaling_factor
        ids[n] = torch.tensor(chosen)
    return weights, ids


def naive_grouped_experts(x, expert_ids, weights, w1, w3, w2, act):
    """Per token and slot: y = x.dtype(w2_e act(w1_e x, w3_e x)); out = x.dtype(sum_j w_j * y_j)
    with the weight multiply and the slot-ordered sum in promote(x.dtype, fp32)."""
    acc = _acc(x.dtype)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for n in range(x.shape[0]):
        xn = x[n : n + 1]
        total = torch.zeros(w2.shape[1], dtype=acc)
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[n, j])
            h = act(xn @ w1[e].T, xn @ w3[e].T)
            y = (h @ w2[e].T).to(x.dtype)[0]
            total = total + weights[n, j].to(acc) * y.to(acc)
        out[n] = total.to(x.dtype)
    return out


def naive_glu_mlp(x, gate_proj, up_proj, down_proj, act):
    """`down(act(gate x, up x))`: dense layer-0 MLP and the fused shared experts (§9, §11)."""
    return act(x @ gate_proj.T, x @ up_proj.T) @ down_proj.T


def naive_moe(
    x,
    gate_weight,
    correction_bias,
    w1,
    w3,
    w2,
    top_k,
    shared=None,
    act=naive_silu_and_mul,
    num_expert_group=1,
    topk_group=1,
    renormalize=True,
    routed_scaling_factor=1.0,
    bias_in_weights=False,
):
    """Kimi-Linear MoE: routed experts on x (SwiGLU by default) plus the shared expert
    `shared = (gate_proj, up_proj, down_proj)` on x, plain add."""
    w, ids = naive_route(
        x,
        gate_weight,
        correction_bias,
        top_k,
        num_expert_group,
        topk_group,
        renormalize,
        routed_scaling_factor,
        bias_in_weights,
    )
    r = naive_grouped_experts(x, ids, w, w1, w3, w2, act)
    if shared is not None:
        r = r + naive_glu_mlp(x, *shared, act)
    return r


def naive_latent_moe(
    x,
    gate_weight,
    correction_bias,
    down_proj,
    up_proj,
    norm_weight,
    w1,
    w3,
    w2,
    top_k,
    shared=None,
    beta=4.0,
    linear_beta=25.0,
    eps=1e-5,
    num_expert_group=1,
    topk_group=1,
    renormalize=True,
    routed_scaling_factor=1.0,
):
    """K3 latent MoE (§9): route on x; z = x down_proj^T; routed SiTU experts on z with the
    bf16 rounding order; RMSNorm(eps) of the weighted sum (skipped if norm_weight is None);
    up_proj; plus the shared SiTU experts on the ORIGINAL x."""
    act: Callable = functools.partial(naive_situ_and_mul, beta=beta, linear_beta=linear_beta)
    w, ids = naive_route(
        x, gate_weight, correction_bias, top_k, num_expert_group, topk_group, renormalize, routed_scaling_factor
    )
    z = x @ down_proj.T
    r = naive_grouped_experts(z, ids, w, w1, w3, w2, act)
    if norm_weight is not None:
        r = naive_rms_norm(r, norm_weight, eps)
    r = r @ up_proj.T
    if shared is not None:
        r = r + naive_glu_mlp(x, *shared, act)
    return r
