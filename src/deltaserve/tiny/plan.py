"""Every tensor of a tiny checkpoint: name, shape, on-disk dtype class and initialiser, in the
order they are drawn (spec/model.md §15.2 for K3, under `language_model.`, plus small
`vision_tower.`/`mm_projector.` tensors a text loader must skip; §15.3 for Kimi-Linear).

- fp32 on disk where the spec says so (K3: conv1d, dt_bias, A_log, o_norm,
  e_score_correction_bias; Kimi-Linear: dt_bias, A_log); everything else in the requested dtype.
- K3 `A_log` is stored padded to twice the head count (tail zeros); Kimi-Linear's is `[1, 1, H, 1]`.
- Routed expert entries carry the module name (no `.weight` suffix): the writer picks the suffixes.
- Init keeps activations O(1): linear weights N(0, 1/fan_in), norms 1 + N(0, 0.1²), decay
  parameters in ranges that give per-token decays between ~0.99 and ~0.5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .presets import VISION, Dims

Init = Callable[[torch.Generator, tuple], torch.Tensor]


@dataclass(frozen=True)
class Entry:
    name: str  # full checkpoint name; for experts the module name (no .weight suffix)
    shape: tuple
    fp32: bool  # stored fp32 regardless of `dtype`
    init: Init
    expert: bool = False


def _normal(std: float) -> Init:
    return lambda g, s: torch.randn(s, generator=g) * std


def _linear(fan_in: int) -> Init:
    return _normal(fan_in**-0.5)


def _norm() -> Init:
    return lambda g, s: 1.0 + 0.1 * torch.randn(s, generator=g)


def _uniform(lo: float, hi: float) -> Init:
    return lambda g, s: lo + (hi - lo) * torch.rand(s, generator=g)


def _k3_a_log(heads: int) -> Init:
    """exp(A_log) in [0.5, 2] for the first `heads` entries, zero padding after."""

    def init(g, s):
        out = torch.zeros(s)
        out[:heads] = math.log(0.5) + math.log(4.0) * torch.rand(heads, generator=g)
        return out

    return init


def _kl_dt_bias(g, s):
    """Mamba-style: softplus(dt_bias) = dt, dt log-uniform in [1e-3, 1e-1]."""
    dt = torch.exp(math.log(1e-3) + math.log(100.0) * torch.rand(s, generator=g))
    return dt + torch.log(-torch.expm1(-dt))


def tensor_plan(family: str, d: Dims, vision: bool = True) -> list[Entry]:
    """Every checkpoint tensor of `family` at sizes `d`, text then (K3 with `vision`) vision."""
    k3 = family == "kimi_k3"
    pre = "language_model.model." if k3 else "model."
    plan = [Entry(pre + "embed_tokens.weight", (d.vocab, d.hidden), False, _normal(1.0))]
    full = set(d.full_attn_layers)
    for i in range(d.layers):
        layer = f"{pre}layers.{i}."

        def add(name, shape, init, fp32=False, expert=False):
            plan.append(Entry(layer + name, tuple(shape), fp32, init, expert))

        add("input_layernorm.weight", (d.hidden,), _norm())
        add("post_attention_layernorm.weight", (d.hidden,), _norm())
        if k3:
            for site in ("self_attention_res", "mlp_res"):
                add(f"{site}_proj.weight", (1, d.hidden), _linear(d.hidden))
                add(f"{site}_norm.weight", (d.hidden,), _norm())
        (_mla if i + 1 in full else _kda)(add, d, k3)
        if i == 0:
            _dense_mlp(add, d)
        else:
            _moe(add, d, k3)
    D = d.hidden
    plan.append(Entry(pre + "norm.weight", (D,), False, _norm()))
    if k3:
        plan.append(Entry(pre + "output_attn_res_proj.weight", (1, D), False, _linear(D)))
        plan.append(Entry(pre + "output_attn_res_norm.weight", (D,), False, _norm()))
        plan.append(Entry("language_model.lm_head.weight", (d.vocab, D), False, _linear(D)))
        if vision:
            plan.extend(_vision_plan(D))
    else:
        plan.append(Entry("lm_head.weight", (d.vocab, D), False, _linear(D)))
    return plan


def _mla(add, d: Dims, k3: bool) -> None:
    a, D, qk = "self_attn.", d.hidden, d.qk_nope + d.qk_rope
    if d.q_lora_rank is not None:
        add(a + "q_a_proj.weight", (d.q_lora_rank, D), _linear(D))
        add(a + "q_a_layernorm.weight", (d.q_lora_rank,), _norm())
        add(a + "q_b_proj.weight", (d.mla_heads * qk, d.q_lora_rank), _linear(d.q_lora_rank))
    else:
        add(a + "q_proj.weight", (d.mla_heads * qk, D), _linear(D))
    add(a + "kv_a_proj_with_mqa.weight", (d.kv_lora_rank + d.qk_rope, D), _linear(D))
    add(a + "kv_a_layernorm.weight", (d.kv_lora_rank,), _norm())
    add(a + "kv_b_proj.weight", (d.mla_heads * (d.qk_nope + d.v_head), d.kv_lora_rank), _linear(d.kv_lora_rank))
    if k3:
        add(a + "g_proj.weight", (d.mla_heads * d.v_head, D), _linear(D))
    add(a + "o_proj.weight", (D, d.mla_heads * d.v_head), _linear(d.mla_heads * d.v_head))


def _kda(add, d: Dims, k3: bool) -> None:
    a, D, hd, H = "self_attn.", d.hidden, d.kda_head_dim, d.kda_heads
    P = H * hd
    for p in "qkv":
        add(a + f"{p}_proj.weight", (P, D), _linear(D))
    for p in "qkv":
        add(a + f"{p}_conv1d.weight", (P, 1, 4), _normal(0.5), fp32=k3)
    add(a + "f_a_proj.weight", (hd, D), _linear(D))
    add(a + "f_b_proj.weight", (P, hd), _linear(hd))
    add(a + "b_proj.weight", (H, D), _linear(D))
    if k3:
        add(a + "A_log", (2 * H,), _k3_a_log(H), fp32=True)
        add(a + "dt_bias", (P,), _uniform(-6.0, -1.0), fp32=True)
        add(a + "g_proj.weight", (P, D), _linear(D))
    else:
        add(a + "A_log", (1, 1, H, 1), lambda g, s: torch.log(_uniform(1.0, 16.0)(g, s)), fp32=True)
        add(a + "dt_bias", (P,), _kl_dt_bias, fp32=True)
        add(a + "g_a_proj.weight", (hd, D), _linear(D))
        add(a + "g_b_proj.weight", (P, hd), _linear(hd))
    add(a + "o_norm.weight", (hd,), _norm(), fp32=k3)
    add(a + "o_proj.weight", (D, P), _linear(P))


def _dense_mlp(add, d: Dims) -> None:
    D = d.hidden
    add("mlp.gate_proj.weight", (d.intermediate, D), _linear(D))
    add("mlp.up_proj.weight", (d.intermediate, D), _linear(D))
    add("mlp.down_proj.weight", (D, d.intermediate), _linear(d.intermediate))


def _moe(add, d: Dims, k3: bool) -> None:
    m, D = "block_sparse_moe.", d.hidden
    add(m + "gate.weight", (d.experts, D), _linear(D))
    add(m + "gate.e_score_correction_bias", (d.experts,), _normal(0.02), fp32=k3)
    din, im = d.latent or D, d.moe_intermediate
    if d.latent is not None:
        add(m + "routed_expert_down_proj.weight", (d.latent, D), _linear(D))
        add(m + "routed_expert_norm.weight", (d.latent,), _norm())
        add(m + "routed_expert_up_proj.weight", (D, d.latent), _linear(d.latent))
    for e in range(d.experts):
        add(m + f"experts.{e}.w1", (im, din), _linear(din), expert=True)
        add(m + f"experts.{e}.w2", (din, im), _linear(im), expert=True)
        add(m + f"experts.{e}.w3", (im, din), _linear(din), expert=True)
    sw = d.shared * im
    add(m + "shared_experts.gate_proj.weight", (sw, D), _linear(D))
    add(m + "shared_experts.up_proj.weight", (sw, D), _linear(D))
    add(m + "shared_experts.down_proj.weight", (D, sw), _linear(sw))


def _vision_plan(text_hidden: int) -> list[Entry]:
    """§12.2/§12.5 tensors at the tiny VISION sizes (unused by the text model)."""
    v, q, f = VISION["vt_hidden_size"], VISION["qkv_hidden_size"], VISION["vt_intermediate_size"]
    p, h, w = VISION["patch_size"], VISION["init_pos_emb_height"], VISION["init_pos_emb_width"]
    merged = v * VISION["merge_kernel_size"][0] * VISION["merge_kernel_size"][1]
    t = "vision_tower."
    out = [
        Entry(t + "patch_embed.proj.weight", (v, 3, p, p), False, _linear(3 * p * p)),
        Entry(t + "patch_embed.pos_emb.weight", (h, w, v), False, _normal(0.02)),
    ]
    for b in range(VISION["vt_num_hidden_layers"]):
        B = f"{t}encoder.blocks.{b}."
        out += [
            Entry(B + "wqkv.weight", (3 * q, v), False, _linear(v)),
            Entry(B + "wo.weight", (v, q), False, _linear(q)),
            Entry(B + "mlp.fc0.weight", (f, v), False, _linear(v)),
            Entry(B + "mlp.fc1.weight", (v, f), False, _linear(f)),
            Entry(B + "norm0.weight", (v,), False, _norm()),
            Entry(B + "norm1.weight", (v,), False, _norm()),
        ]
    out += [
        Entry(t + "encoder.final_layernorm.weight", (v,), False, _norm()),
        Entry("mm_projector.proj.0.weight", (merged, merged), False, _linear(merged)),
        Entry("mm_projector.proj.2.weight", (text_hidden, merged), False, _linear(merged)),
        Entry("mm_projector.post_norm.weight", (text_hidden,), False, _norm()),
    ]
    return out
