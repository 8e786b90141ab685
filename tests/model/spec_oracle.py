"""Float64 whole-model oracle written straight from spec/model.md (§1-11, §15-16).

Independent of `deltaserve.model`: the checkpoint is read with `json` and `safetensors`, MXFP4
experts are decoded with the naive `deltaserve.ops.reference.mxfp4` oracle, and every formula
below is the spec's, evaluated in float64 with plain loops (no bf16 rounding anywhere).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from deltaserve.ops.reference.mxfp4 import naive_mxfp4_decode

F64 = torch.float64


@dataclass
class SpecCheckpoint:
    """Text config (a plain dict) and text tensors as float64, names without the family prefix
    (`layers.{i}.…`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`)."""

    family: str
    cfg: dict
    w: dict[str, torch.Tensor] = field(repr=False)

    def layer_type(self, i: int) -> str:
        """§1.2: 0-based layer i is KDA iff i+1 is in kda_layers, MLA iff in full_attn_layers."""
        lin = self.cfg["linear_attn_config"]
        return "kda" if i + 1 in lin["kda_layers"] else "mla"


def load_spec_checkpoint(path: str | Path) -> SpecCheckpoint:
    """Parse config.json and every shard of model.safetensors.index.json (§1, §15)."""
    path = Path(path)
    top = json.loads((path / "config.json").read_text())
    k3 = "text_config" in top
    cfg = top["text_config"] if k3 else top
    lin = cfg["linear_attn_config"]
    n_layers = cfg["num_hidden_layers"]
    kda, mla = set(lin["kda_layers"]), set(lin["full_attn_layers"])
    assert kda.isdisjoint(mla) and kda | mla == set(range(1, n_layers + 1))

    strip = ("language_model.model.", "language_model.") if k3 else ("model.", "")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():
                for p in strip:
                    if name.startswith(p):
                        raw[name[len(p) :]] = f.get_tensor(name)
                        break
    w: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".weight_scale"):
            continue
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            w[base] = naive_mxfp4_decode(t, raw[base + "_scale"])
        else:
            w[name] = t.to(F64)
    heads = lin["num_heads"]
    for i in range(n_layers):
        key = f"layers.{i}.self_attn.A_log"
        if key in w:  # K3 [2H] zero-padded, Kimi-Linear [1, 1, H, 1]
            flat = w[key].reshape(-1)
            assert not flat[heads:].any()
            w[key] = flat[:heads]
    return SpecCheckpoint("kimi_k3" if k3 else "kimi_linear", cfg, w)


def sub(ck: SpecCheckpoint, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, keyed by the rest of their name."""
    return {k[len(prefix) :]: v for k, v in ck.w.items() if k.startswith(prefix)}


# ---------------------------------------------------------------- §3, §10: norms, activations


def rms_norm(x, weight, eps):
    """KimiRMSNorm (weight may be None: weightless)."""
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else weight * y


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def glu_act(cfg, gate, up):
    """SiTU (K3, §10) or SwiGLU (Kimi-Linear)."""
    if cfg["hidden_act"] == "situ":
        b, bl = cfg["activation_situ_beta"], cfg.get("activation_situ_linear_beta")
        right = up if bl is None else bl * torch.tanh(up / bl)
        return b * torch.tanh(gate / b) * sigmoid(gate) * right
    return gate * sigmoid(gate) * up


def glu_mlp(cfg, x, w, pre):
    """§11 dense MLP and the fused shared experts: down(act(gate x, up x))."""
    return (
        glu_act(cfg, x @ w[pre + "gate_proj.weight"].T, x @ w[pre + "up_proj.weight"].T) @ w[pre + "down_proj.weight"].T
    )


# ---------------------------------------------------------------- §6: KDA


def kda(ck: SpecCheckpoint, i: int, x: torch.Tensor, l2_eps: float = 1e-6) -> torch.Tensor:
    """§6.2 token by token for one sequence x [T, D] (normalised layer input)."""
    cfg, lin = ck.cfg, ck.cfg["linear_attn_config"]
    w = sub(ck, f"layers.{i}.self_attn.")
    t_len, h, d = x.shape[0], lin["num_heads"], lin["head_dim"]
    width = lin["short_conv_kernel_size"]

    def conv_silu(u, weight):  # causal depthwise conv over pre-conv inputs
        u = torch.cat([u.new_zeros(width - 1, u.shape[1]), u])
        y = sum(weight[:, 0, j] * u[j : j + t_len] for j in range(width))
        return y * sigmoid(y)

    def l2(v):
        return v / torch.sqrt((v * v).sum(-1, keepdim=True) + l2_eps)

    q, k, v = (conv_silu(x @ w[f"{p}_proj.weight"].T, w[f"{p}_conv1d.weight"]).view(t_len, h, d) for p in "qkv")
    q, k = l2(q), l2(k)
    f = ((x @ w["f_a_proj.weight"].T) @ w["f_b_proj.weight"].T).view(t_len, h, d)
    a = torch.exp(w["A_log"]).view(h, 1)
    pre = f + w["dt_bias"].view(h, d)
    if "gate_lower_bound" in lin:
        g = lin["gate_lower_bound"] * sigmoid(a * pre)
    else:
        g = -a * torch.log1p(torch.exp(pre))
    beta = sigmoid(x @ w["b_proj.weight"].T)
    o = x.new_zeros(t_len, h, d)
    s = x.new_zeros(h, d, d)  # per head [key, value]
    for t in range(t_len):
        s = torch.exp(g[t])[:, :, None] * s
        pred = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + beta[t, :, None, None] * torch.einsum("hk,hv->hkv", k[t], v[t] - pred)
        o[t] = d**-0.5 * torch.einsum("hk,hkv->hv", q[t], s)
    if lin.get("use_full_rank_gate"):
        gate = x @ w["g_proj.weight"].T
    else:
        gate = (x @ w["g_a_proj.weight"].T) @ w["g_b_proj.weight"].T
    o = rms_norm(o, w["o_norm.weight"], cfg["rms_norm_eps"]) * sigmoid(gate.view(t_len, h, d))
    return o.reshape(t_len, h * d) @ w["o_proj.weight"].T


# ---------------------------------------------------------------- §7: MLA (plain, NoPE)


def mla(ck: SpecCheckpoint, i: int, x: torch.Tensor, latent_eps: float = 1e-6) -> torch.Tensor:
    """§7.2 for one causal sequence x [T, D]: k_rot shared by all heads and unrotated, scores
    scaled by (nope + rope)^-1/2, optional sigmoid output gate before o_proj."""
    cfg, w = ck.cfg, sub(ck, f"layers.{i}.self_attn.")
    t_len, h = x.shape[0], cfg["num_attention_heads"]
    nope, rot, dv, r = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"])
    if cfg.get("q_lora_rank") is not None:
        c_q = rms_norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], latent_eps)
        q = c_q @ w["q_b_proj.weight"].T
    else:
        q = x @ w["q_proj.weight"].T
    q = q.view(t_len, h, nope + rot)
    kv = x @ w["kv_a_proj_with_mqa.weight"].T
    c_hat = rms_norm(kv[:, :r], w["kv_a_layernorm.weight"], latent_eps)
    k_rot = kv[:, r:]
    kvb = (c_hat @ w["kv_b_proj.weight"].T).view(t_len, h, nope + dv)
    future = torch.ones(t_len, t_len, dtype=torch.bool).triu(1)
    heads = []
    for hh in range(h):
        k_h = torch.cat([kvb[:, hh, :nope], k_rot], -1)
        scores = (q[:, hh] @ k_h.T) * (nope + rot) ** -0.5
        heads.append(torch.softmax(scores.masked_fill(future, -torch.inf), -1) @ kvb[:, hh, nope:])
    o = torch.cat(heads, -1)  # [T, H * dv]
    if cfg.get("mla_use_output_gate"):
        o = o * sigmoid(x @ w["g_proj.weight"].T)
    return o @ w["o_proj.weight"].T


# ---------------------------------------------------------------- §8-9: router and MoE


def moe(ck: SpecCheckpoint, i: int, x: torch.Tensor) -> torch.Tensor:
    """§8 sigmoid router (bias selects, unbiased scores weigh) and §9 (latent) MoE, per token."""
    cfg, w = ck.cfg, sub(ck, f"layers.{i}.block_sparse_moe.")
    top_k, n_exp = cfg["num_experts_per_token"], cfg["num_experts"]
    assert cfg.get("num_expert_group", 1) == 1 and cfg.get("topk_group", 1) == 1
    latent = cfg.get("routed_expert_hidden_size") is not None
    z = x @ w["routed_expert_down_proj.weight"].T if latent else x
    routed = x.new_zeros(z.shape)
    for n in range(x.shape[0]):
        s = sigmoid(w["gate.weight"] @ x[n])
        pick = s + w["gate.e_score_correction_bias"]
        chosen = sorted(range(n_exp), key=lambda e: -float(pick[e]))[:top_k]
        weights = s[chosen]
        if cfg.get("moe_renormalize", True):
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * cfg.get("routed_scaling_factor", 1.0)
        w1, w3, w2 = (torch.stack([w[f"experts.{e}.{m}.weight"] for e in chosen]) for m in ("w1", "w3", "w2"))
        hid = glu_act(cfg, w1 @ z[n], w3 @ z[n])  # [k, I]
        routed[n] = weights @ torch.einsum("kdi,ki->kd", w2, hid)
    if latent:
        if cfg.get("latent_moe_use_norm"):
            routed = rms_norm(routed, w["routed_expert_norm.weight"], cfg["rms_norm_eps"])
        routed = routed @ w["routed_expert_up_proj.weight"].T
    if cfg.get("num_shared_experts"):
        routed = routed + glu_mlp(cfg, x, w, "shared_experts.")
    return routed


# ---------------------------------------------------------------- §4-5: decoder, §2: head


def attn_res_mix(cur, bank, proj, norm):
    """§5 Mix: softmax over [*bank, cur] of rmsnorm_weightless(X_s) . (n * p), mixes raw X."""
    x = torch.stack([*bank, cur])  # [S, T, D]
    e = rms_norm(x, None, 1e-5) @ (norm * proj.reshape(-1))  # [S, T]
    return (torch.softmax(e, 0)[..., None] * x).sum(0)


def spec_logits(
    ck: SpecCheckpoint, ids: torch.Tensor, kda_l2_eps: float = 1e-6, mla_latent_eps: float = 1e-6
) -> torch.Tensor:
    """Float64 logits [T, vocab] of one sequence `ids` [T] (no cache)."""
    cfg, w = ck.cfg, ck.w
    eps = cfg["rms_norm_eps"]
    n_dense = cfg.get("first_k_dense_replace", 1)

    def attn(i, h):
        x = rms_norm(h, w[f"layers.{i}.input_layernorm.weight"], eps)
        if ck.layer_type(i) == "kda":
            return kda(ck, i, x, kda_l2_eps)
        return mla(ck, i, x, mla_latent_eps)

    def ffn(i, h):
        x = rms_norm(h, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        return glu_mlp(cfg, x, w, f"layers.{i}.mlp.") if i < n_dense else moe(ck, i, x)

    h = w["embed_tokens.weight"][ids]
    block = cfg.get("attn_res_block_size")
    if block is None:  # §4 plain pre-norm
        for i in range(cfg["num_hidden_layers"]):
            h = h + attn(i, h)
            h = h + ffn(i, h)
    else:  # §5 Block AttnRes
        bank: list[torch.Tensor] = []
        cur = h
        for i in range(cfg["num_hidden_layers"]):
            lw = sub(ck, f"layers.{i}.")
            x_attn = (
                cur
                if not bank
                else attn_res_mix(cur, bank, lw["self_attention_res_proj.weight"], lw["self_attention_res_norm.weight"])
            )
            if i % block == 0:
                bank.append(cur)
                cur = None
            a = attn(i, x_attn)
            cur = a if cur is None else cur + a
            x_ffn = attn_res_mix(cur, bank, lw["mlp_res_proj.weight"], lw["mlp_res_norm.weight"])
            cur = cur + ffn(i, x_ffn)
        h = attn_res_mix(cur, bank, w["output_attn_res_proj.weight"], w["output_attn_res_norm.weight"])
    return rms_norm(h, w["norm.weight"], eps) @ w["lm_head.weight"].T


__all__ = ["SpecCheckpoint", "load_spec_checkpoint", "spec_logits"]
