"""Deliberately configurable re-implementations for the §18 checklist tests: each function
evaluates one part of the model in float64 from the spec, with switches that produce the
wrong variants the checklist names (see tests/model/test_checklist.py)."""

import copy
import dataclasses
import functools

import torch
import torch.nn.functional as F

from deltaserve.model.context import ForwardContext
from deltaserve.ops.backends import torch as ops_backend
from deltaserve.ops.norms import rms_norm
from deltaserve.ops.reference import dense as RD
from deltaserve.ops.reference import kda as RK


def params(module):
    return {n: p.detach().double() for n, p in module.named_parameters()}


def walk(
    model, tokens, embed_scale=1.0, bank_before_mix=False, bank_h0=True, reset_to_h0=False, res_norm_as_norm=False
):
    """Decoder stack written from spec §4/§5 pseudocode over the model's own Attn/FFN modules."""
    st, ctx = model.model, ForwardContext.single(len(tokens))
    h0 = st.embed_tokens(tokens) * embed_scale
    block = model.config.attn_res_block_size
    if block is None:  # plain residual (vs transformers: tests/model/test_forward.py)
        return st.norm(functools.reduce(lambda h, layer: layer.forward_residual(h, ctx), st.layers, h0))

    def mix(cur, bank, proj, norm):
        if not res_norm_as_norm:
            return RD.naive_attn_res_mix(cur, bank, proj.weight, norm.weight)
        out = RD.naive_attn_res_mix(cur, bank, proj.weight, torch.ones_like(norm.weight))
        return rms_norm(out, norm.weight, 1e-5)

    bank, cur = [], h0
    for i, layer in enumerate(st.layers):
        boundary = i % block == 0
        early = boundary and bank_before_mix and i > 0  # wrong: the finished block enters twice
        if early:
            bank.append(cur)
        x_attn = cur if not bank else mix(cur, bank, layer.self_attention_res_proj, layer.self_attention_res_norm)
        if boundary:
            if (bank_h0 or i > 0) and not early:
                bank.append(cur)
            cur = h0 if reset_to_h0 and i > 0 else None
        a = layer.attention(x_attn, ctx)
        cur = a if cur is None else cur + a
        x_ffn = mix(cur, bank, layer.mlp_res_proj, layer.mlp_res_norm)
        cur = cur + layer.ffn(layer.post_attention_layernorm(x_ffn))
    return st.norm(mix(cur, bank, st.output_attn_res_proj, st.output_attn_res_norm))


def kda_ref(
    layer,
    x,
    from_conv=(),
    gate_kind=None,
    per_head=False,
    read_before=False,
    l2_eps=1e-6,
    eps_outside=False,
    scale=None,
    a_log=None,
):
    """Spec §6.2 in float64 -> (core output before o_norm [T, H, d], layer output [T, D], state)."""
    p, xd = params(layer), x.double()
    n, h, dk = x.shape[0], layer.num_heads, layer.head_dim
    pre = torch.cat([xd @ p[f"{c}_proj.weight"].T for c in "qkv"], -1)
    mixed, _ = RK.naive_causal_conv1d(pre, torch.cat([p[f"{c}_conv1d.weight"] for c in "qkv"]).squeeze(1))
    q, k, v = mixed.view(n, 3, h, dk).unbind(1)
    if eps_outside:
        q, k = (z / (z.norm(dim=-1, keepdim=True) + l2_eps) for z in (q, k))
    else:
        q, k = RK.naive_l2_norm(q, l2_eps), RK.naive_l2_norm(k, l2_eps)

    def src(what):  # wrong variant: read the conv output (tiny K3 has P == D)
        return v.reshape(n, -1) if what in from_conv else xd

    f = ((src("g") @ p["f_a_proj.weight"].T) @ p["f_b_proj.weight"].T).view(n, h, dk)
    a = p["A_log"] if a_log is None else a_log.double()
    if (gate_kind or ("sigmoid" if layer.lower_bound is not None else "softplus")) == "sigmoid":
        g = RK.naive_kda_gate_sigmoid(f, a, p["dt_bias"], -5.0)
    else:
        g = RK.naive_kda_gate_softplus(f, a, p["dt_bias"])
    if per_head:
        g = g.mean(-1, keepdim=True).expand_as(g)
    beta = torch.sigmoid(src("beta") @ p["b_proj.weight"].T)
    sc = dk**-0.5 if scale is None else scale
    o, s = RK.naive_recurrent_kda(q, k, v, g, beta, sc)
    if read_before:  # wrong: read the decayed state before the delta update
        s_t = torch.zeros_like(s)
        for t in range(n):
            s_t = g[t].exp()[..., None] * s_t
            o[t] = sc * torch.einsum("hk,hkv->hv", q[t], s_t)
            s_t = s_t + beta[t][:, None, None] * torch.einsum(
                "hk,hv->hkv", k[t], v[t] - torch.einsum("hk,hkv->hv", k[t], s_t)
            )
    gx = src("gate")
    gate = gx @ p["g_proj.weight"].T if "g_proj.weight" in p else (gx @ p["g_a_proj.weight"].T) @ p["g_b_proj.weight"].T
    out = RD.naive_gated_rms_norm(o, p["o_norm.weight"], gate.view(n, h, dk), 1e-5, torch.float64)
    return o, out.reshape(n, -1) @ p["o_proj.weight"].T, s


def run_kda(layer, x, monkeypatch):
    """(core output captured at the layer's o_norm, layer output)."""
    seen = []
    real = ops_backend.gated_rms_norm  # the reference backend's KDA output norm
    monkeypatch.setattr(ops_backend, "gated_rms_norm", lambda o, *a: seen.append(o) or real(o, *a))
    with torch.inference_mode():
        out = layer(x, ForwardContext.single(len(x)))
    return seen[0], out


def mla_ref(layer, x, rot="keep", scale=None, gate="sigmoid", eps=1e-6):
    """Spec §7.2 in float64; rot: keep the unrotated k_rot/q_rot columns, or drop them."""
    p, xd = params(layer), x.double()
    n, h, nope, r = x.shape[0], layer.num_heads, layer.nope, layer.rank
    if "q_a_proj.weight" in p:
        q = RD.naive_rms_norm(xd @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], eps) @ p["q_b_proj.weight"].T
    else:
        q = xd @ p["q_proj.weight"].T
    q = q.view(n, h, -1)
    kv = xd @ p["kv_a_proj_with_mqa.weight"].T
    kvb = (RD.naive_rms_norm(kv[:, :r], p["kv_a_layernorm.weight"], eps) @ p["kv_b_proj.weight"].T).view(n, h, -1)
    q_rot, k_rot = q[..., nope:], kv[:, None, r:].expand(n, h, -1)
    qh = torch.cat([q[..., :nope]] + [q_rot] * (rot == "keep"), -1)
    kh = torch.cat([kvb[..., :nope]] + [k_rot] * (rot == "keep"), -1)
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("thd,shd->hts", qh, kh) * sc
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), kvb[..., nope:]).reshape(n, -1)
    if "g_proj.weight" in p and gate:
        g = xd @ p["g_proj.weight"].T
        o = o * (torch.sigmoid(g) if gate == "sigmoid" else F.silu(g))
    return o @ p["o_proj.weight"].T


def moe_ref(blk, x, scale, bias_in_weights=False, norm="after_sum"):
    """Spec §8-9 in float64 with the block's parameters (K3 latent MoE or Kimi-Linear MoE)."""
    p, xd, m = params(blk), x.double(), blk.cfg
    ex = (p["experts.w1"], p["experts.w3"], p["experts.w2"])
    shared = tuple(p[f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    gate, bias = p["gate.weight"], p["gate.e_score_correction_bias"]
    if m.latent_size is None:
        return RD.naive_moe(
            xd, gate, bias, *ex, m.top_k, shared, routed_scaling_factor=scale, bias_in_weights=bias_in_weights
        )
    act = functools.partial(RD.naive_situ_and_mul, beta=4.0, linear_beta=25.0)
    w, sel = RD.naive_route(xd, gate, bias, m.top_k, routed_scaling_factor=scale, bias_in_weights=bias_in_weights)
    z = xd @ p["routed_expert_down_proj.weight"].T
    nw = p["routed_expert_norm.weight"]
    if norm == "per_expert":
        one = torch.ones_like(w[:, :1])
        r = sum(
            w[:, j : j + 1] * RD.naive_rms_norm(RD.naive_grouped_experts(z, sel[:, j : j + 1], one, *ex, act), nw, 1e-5)
            for j in range(m.top_k)
        )
    else:
        r = RD.naive_grouped_experts(z, sel, w, *ex, act)
        r = r if norm == "none" else RD.naive_rms_norm(r, nw, 1e-5)
    return r @ p["routed_expert_up_proj.weight"].T + RD.naive_glu_mlp(xd, *shared, act)


def block64(model, layer=2, **cfg):
    blk = copy.deepcopy(model.model.layers[layer].block_sparse_moe).double()
    blk.gate.e_score_correction_bias.data *= 20  # bias large enough to matter
    blk.cfg = dataclasses.replace(blk.cfg, **cfg)
    blk.route_spec = dataclasses.replace(blk.route_spec, **cfg)  # the router's constants, taken at init
    return blk
