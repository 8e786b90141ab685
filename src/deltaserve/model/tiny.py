"""Random-weight checkpoints in the real Hugging Face layout (spec/model.md §1, §12, §15-16).

`make_tiny` writes `config.json`, `generation_config.json`, safetensors shards with
`model.safetensors.index.json`, and the tokenizer files (`tiny_tokenizer`). Tensor names, dtypes
and shapes follow §15.2 (K3, under `language_model.`, plus small `vision_tower.`/`mm_projector.`
tensors a text loader must skip) and §15.3 (Kimi-Linear). Invariants:

- Layer pattern: 1-based MLA layers = every 4th layer plus the last; the rest are KDA (§1.2).
- fp32 on disk where the spec says so (K3: conv1d, dt_bias, A_log, o_norm,
  e_score_correction_bias; Kimi-Linear: dt_bias, A_log); everything else in `dtype`.
- K3 `A_log` is stored padded to twice the head count (tail zeros); Kimi-Linear's is `[1, 1, H, 1]`.
- Routed expert weights are always MXFP4-representable (drawn, then `mxfp4_encode`d): with
  `mxfp4` they are stored packed (`weight_packed`/`weight_scale`), otherwise decoded to `dtype`
  as `.weight`, so the two variants of one seed define the same model exactly.
- Init keeps activations O(1): linear weights N(0, 1/fan_in), norms 1 + N(0, 0.1²), decay
  parameters in ranges that give per-token decays between ~0.99 and ~0.5.
- Deterministic in `seed`: one generator, tensors drawn in a fixed order independent of sharding.

Presets (`mini` params count routed experts at their logical bf16 size):

| preset | family | D | layers (MLA, 0-based) | KDA H×d | MLA H, q/kv rank | experts (top-k, shared) | params |
|---|---|---|---|---|---|---|---|
| tiny | kimi_k3 | 64 | 5 (3, 4) | 2×32 | 2, 32/32 | 8×32 (4, 2), latent 32 | 0.62M |
| tiny | kimi_linear | 96 | 6 (3, 5) | 2×32 | 2, -/32 | 8×32 (2, 1) | 1.04M |
| mini | kimi_k3 | 1024 | 17 (3, 7, 11, 15, 16) | 8×128 | 8, 384/512 | 64×512 (8, 2), latent 512 | 1.04B |
| mini | kimi_linear | 768 | 13 (3, 7, 11, 12) | 6×128 | 6, -/512 | 64×256 (8, 1) | 0.55B |
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ..ops.mxfp4 import GROUP_SIZE, mxfp4_decode, mxfp4_encode
from .tiny_tokenizer import EOS_NAME, write_tokenizer

FAMILIES = ("kimi_k3", "kimi_linear")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    vocab: int
    kda_heads: int
    kda_head_dim: int
    mla_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    intermediate: int
    experts: int
    top_k: int
    shared: int
    moe_intermediate: int
    latent: int | None              # K3 routed_expert_hidden_size; None: experts at D
    attn_res_block: int | None
    shard_bytes: int
    mxfp4: bool                     # default when make_tiny(mxfp4=None)

    @property
    def full_attn_layers(self) -> list[int]:
        return sorted(set(range(4, self.layers + 1, 4)) | {self.layers})

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(1, self.layers + 1) if i not in self.full_attn_layers]


_K3_TINY = Dims(hidden=64, layers=5, vocab=2048, kda_heads=2, kda_head_dim=32, mla_heads=2,
                q_lora_rank=32, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16, intermediate=192,
                experts=8, top_k=4, shared=2, moe_intermediate=32, latent=32, attn_res_block=2,
                shard_bytes=1 << 20, mxfp4=False)
_KL_TINY = Dims(hidden=96, layers=6, vocab=2048, kda_heads=2, kda_head_dim=32, mla_heads=2,
                q_lora_rank=None, kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16, intermediate=192,
                experts=8, top_k=2, shared=1, moe_intermediate=32, latent=None, attn_res_block=None,
                shard_bytes=1 << 20, mxfp4=False)
_K3_MINI = Dims(hidden=1024, layers=17, vocab=32768, kda_heads=8, kda_head_dim=128, mla_heads=8,
                q_lora_rank=384, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
                intermediate=2816, experts=64, top_k=8, shared=2, moe_intermediate=512, latent=512,
                attn_res_block=4, shard_bytes=256 << 20, mxfp4=True)
_KL_MINI = Dims(hidden=768, layers=13, vocab=32768, kda_heads=6, kda_head_dim=128, mla_heads=6,
                q_lora_rank=None, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
                intermediate=2048, experts=64, top_k=8, shared=1, moe_intermediate=256, latent=None,
                attn_res_block=None, shard_bytes=256 << 20, mxfp4=False)
PRESETS = {("kimi_k3", "tiny"): _K3_TINY, ("kimi_linear", "tiny"): _KL_TINY,
           ("kimi_k3", "mini"): _K3_MINI, ("kimi_linear", "mini"): _KL_MINI}

Init = Callable[[torch.Generator, tuple], torch.Tensor]


@dataclass(frozen=True)
class Entry:
    name: str            # full checkpoint name; for experts the module name (no .weight suffix)
    shape: tuple
    fp32: bool           # stored fp32 regardless of `dtype`
    init: Init
    expert: bool = False


def _normal(std: float) -> Init:
    return lambda g, s: torch.randn(s, generator=g) * std


def _linear(fan_in: int) -> Init:
    return _normal(fan_in ** -0.5)


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


def _plan(family: str, d: Dims) -> list[Entry]:
    k3 = family == "kimi_k3"
    D, hd, H = d.hidden, d.kda_head_dim, d.kda_heads
    P = H * hd
    pre = "language_model.model." if k3 else "model."
    plan = [Entry(pre + "embed_tokens.weight", (d.vocab, D), False, _normal(1.0))]
    full = set(d.full_attn_layers)
    for i in range(d.layers):
        L = f"{pre}layers.{i}."

        def add(name, shape, init, fp32=False, expert=False):
            plan.append(Entry(L + name, tuple(shape), fp32, init, expert))

        add("input_layernorm.weight", (D,), _norm())
        add("post_attention_layernorm.weight", (D,), _norm())
        if k3:
            for site in ("self_attention_res", "mlp_res"):
                add(f"{site}_proj.weight", (1, D), _linear(D))
                add(f"{site}_norm.weight", (D,), _norm())
        a = "self_attn."
        if i + 1 in full:
            qk = d.qk_nope + d.qk_rope
            if d.q_lora_rank is not None:
                add(a + "q_a_proj.weight", (d.q_lora_rank, D), _linear(D))
                add(a + "q_a_layernorm.weight", (d.q_lora_rank,), _norm())
                add(a + "q_b_proj.weight", (d.mla_heads * qk, d.q_lora_rank), _linear(d.q_lora_rank))
            else:
                add(a + "q_proj.weight", (d.mla_heads * qk, D), _linear(D))
            add(a + "kv_a_proj_with_mqa.weight", (d.kv_lora_rank + d.qk_rope, D), _linear(D))
            add(a + "kv_a_layernorm.weight", (d.kv_lora_rank,), _norm())
            add(a + "kv_b_proj.weight", (d.mla_heads * (d.qk_nope + d.v_head), d.kv_lora_rank),
                _linear(d.kv_lora_rank))
            if k3:
                add(a + "g_proj.weight", (d.mla_heads * d.v_head, D), _linear(D))
            add(a + "o_proj.weight", (D, d.mla_heads * d.v_head), _linear(d.mla_heads * d.v_head))
        else:
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
        if i == 0:
            add("mlp.gate_proj.weight", (d.intermediate, D), _linear(D))
            add("mlp.up_proj.weight", (d.intermediate, D), _linear(D))
            add("mlp.down_proj.weight", (D, d.intermediate), _linear(d.intermediate))
            continue
        m = "block_sparse_moe."
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
    plan.append(Entry(pre + "norm.weight", (D,), False, _norm()))
    if k3:
        plan.append(Entry(pre + "output_attn_res_proj.weight", (1, D), False, _linear(D)))
        plan.append(Entry(pre + "output_attn_res_norm.weight", (D,), False, _norm()))
        plan.append(Entry("language_model.lm_head.weight", (d.vocab, D), False, _linear(D)))
        plan.extend(_vision_plan(D))
    else:
        plan.append(Entry("lm_head.weight", (d.vocab, D), False, _linear(D)))
    return plan


VISION = dict(vt_hidden_size=32, mm_hidden_size=32, vt_num_hidden_layers=1, vt_num_attention_heads=2,
              qkv_hidden_size=32, vt_intermediate_size=64, patch_size=14, merge_kernel_size=[2, 2],
              merge_type="sd2_tpool", mm_projector_type="patchmergerv2", projector_hidden_act="gelu",
              projector_ln_eps=1e-5, activation_func="gelu_pytorch_tanh", norm_type="rmsnorm",
              init_pos_emb_height=4, init_pos_emb_width=4, pos_emb_interpolation_mode="bilinear")


def _vision_plan(text_hidden: int) -> list[Entry]:
    """§12.2/§12.5 tensors at the tiny VISION sizes (unused by the text model)."""
    v, q, f = VISION["vt_hidden_size"], VISION["qkv_hidden_size"], VISION["vt_intermediate_size"]
    p, h, w = VISION["patch_size"], VISION["init_pos_emb_height"], VISION["init_pos_emb_width"]
    merged = v * VISION["merge_kernel_size"][0] * VISION["merge_kernel_size"][1]
    t = "vision_tower."
    out = [Entry(t + "patch_embed.proj.weight", (v, 3, p, p), False, _linear(3 * p * p)),
           Entry(t + "patch_embed.pos_emb.weight", (h, w, v), False, _normal(0.02))]
    for b in range(VISION["vt_num_hidden_layers"]):
        B = f"{t}encoder.blocks.{b}."
        out += [Entry(B + "wqkv.weight", (3 * q, v), False, _linear(v)),
                Entry(B + "wo.weight", (v, q), False, _linear(q)),
                Entry(B + "mlp.fc0.weight", (f, v), False, _linear(v)),
                Entry(B + "mlp.fc1.weight", (v, f), False, _linear(f)),
                Entry(B + "norm0.weight", (v,), False, _norm()),
                Entry(B + "norm1.weight", (v,), False, _norm())]
    out += [Entry(t + "encoder.final_layernorm.weight", (v,), False, _norm()),
            Entry("mm_projector.proj.0.weight", (merged, merged), False, _linear(merged)),
            Entry("mm_projector.proj.2.weight", (text_hidden, merged), False, _linear(merged)),
            Entry("mm_projector.post_norm.weight", (text_hidden,), False, _norm())]
    return out


def _nbytes(e: Entry, dtype: torch.dtype, mxfp4: bool) -> int:
    n = math.prod(e.shape)
    if e.expert and mxfp4:
        return n // 2 + n // GROUP_SIZE
    return n * (4 if e.fp32 else torch.empty((), dtype=dtype).element_size())


def param_count(family: str, preset: str = "tiny") -> int:
    """Logical parameter count of a preset (text and vision, experts unpacked)."""
    return sum(math.prod(e.shape) for e in _plan(family, PRESETS[(family, preset)]))


def _materialise(e: Entry, g: torch.Generator, dtype: torch.dtype, mxfp4: bool) -> dict[str, torch.Tensor]:
    w = e.init(g, e.shape).float()
    if e.expert:
        packed, scale = mxfp4_encode(w)
        if mxfp4:
            return {e.name + ".weight_packed": packed, e.name + ".weight_scale": scale}
        return {e.name + ".weight": mxfp4_decode(packed, scale, dtype)}
    return {e.name: w if e.fp32 else w.to(dtype)}


def _shards(sizes: list[int], limit: int) -> list[int]:
    """Shard index per entry: consecutive runs of about total/n bytes, n = max(2, total/limit)."""
    total = sum(sizes)
    n = min(len(sizes), max(2, math.ceil(total / limit)))
    out, acc = [], 0
    for s in sizes:
        out.append(min(n - 1, acc * n // total))
        acc += s
    ranks = {k: r for r, k in enumerate(sorted(set(out)))}
    out = [ranks[k] for k in out]
    if max(out) == 0:                       # one tensor dominates: split off the last entry
        out[-1] = 1
    return out


def _quantization_config() -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": GROUP_SIZE,
                        "symmetric": True, "dynamic": False, "scale_dtype": "uint8"},
            "input_activations": None, "output_activations": None, "format": "mxfp4-pack-quantized"}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    }


def _text_config(family: str, d: Dims, ids: dict, mxfp4: bool, dtype_name: str) -> dict:
    k3 = family == "kimi_k3"
    lin = {"num_heads": d.kda_heads, "head_dim": d.kda_head_dim, "short_conv_kernel_size": 4}
    if k3:
        lin.update(use_full_rank_gate=True, gate_lower_bound=-5.0)
    lin.update(kda_layers=d.kda_layers, full_attn_layers=d.full_attn_layers)
    cfg = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": d.vocab, "hidden_size": d.hidden, "num_hidden_layers": d.layers,
        "rms_norm_eps": 1e-5, "num_attention_heads": d.mla_heads, "num_key_value_heads": d.mla_heads,
        "q_lora_rank": d.q_lora_rank, "kv_lora_rank": d.kv_lora_rank, "qk_nope_head_dim": d.qk_nope,
        "qk_rope_head_dim": d.qk_rope, "v_head_dim": d.v_head, "mla_use_nope": True,
        "rope_theta": 10000.0, "linear_attn_config": lin, "first_k_dense_replace": 1,
        "intermediate_size": d.intermediate, "moe_layer_freq": 1, "num_experts": d.experts,
        "num_experts_per_token": d.top_k, "num_shared_experts": d.shared,
        "moe_intermediate_size": d.moe_intermediate, "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": ids["[BOS]"], "eos_token_id": ids[EOS_NAME[family]], "pad_token_id": ids["[PAD]"],
        "use_cache": True, "dtype": dtype_name,
    }
    if k3:
        cfg.update(mla_use_output_gate=True, routed_expert_hidden_size=d.latent, latent_moe_use_norm=True,
                   topk_method="noaux_tc", routed_scaling_factor=1.0, hidden_act="situ",
                   activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
                   attn_res_block_size=d.attn_res_block, max_position_embeddings=1 << 20)
    else:
        # top-level head_dim as the real config has it: hidden/heads, deliberately no real width
        cfg.update(routed_scaling_factor=2.446, hidden_act="silu", rope_scaling=None,
                   head_dim=d.hidden // d.mla_heads, model_max_length=1 << 20)
    if mxfp4:
        cfg["quantization_config"] = _quantization_config()
    return cfg


def _config(family: str, d: Dims, ids: dict, mxfp4: bool, dtype_name: str) -> dict:
    text = _text_config(family, d, ids, mxfp4, dtype_name)
    if family == "kimi_linear":
        return text
    vision = dict(VISION, text_hidden_size=d.hidden)
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text, "vision_config": vision,
            "media_placeholder_token_id": ids["<|media_pad|>"],
            "image_placeholder": "<|kimi_image_placeholder|>",
            "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
            "pad_token_id": text["pad_token_id"], "tie_word_embeddings": False, "dtype": dtype_name}


def make_tiny(out_dir: str | Path, family: str, preset: str = "tiny", mxfp4: bool | None = None,
              seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a random-weight checkpoint of `family` at `preset` size into `out_dir` and return
    it. `mxfp4=None` takes the preset's default (tiny: bf16 experts, K3 mini: MXFP4)."""
    if (family, preset) not in PRESETS:
        raise ValueError(f"unknown family/preset {family!r}/{preset!r}; families {FAMILIES},"
                         " presets ('tiny', 'mini')")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    d = PRESETS[(family, preset)]
    mxfp4 = d.mxfp4 if mxfp4 is None else mxfp4
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, family, d.vocab, 1 << 20)
    cfg = _config(family, d, ids, mxfp4, _DTYPE_NAMES[dtype])
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": ids["[BOS]"], "eos_token_id": ids[EOS_NAME[family]],
               "pad_token_id": ids["[PAD]"]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")

    plan = _plan(family, d)
    shard_of = _shards([_nbytes(e, dtype, mxfp4) for e in plan], d.shard_bytes)
    n = max(shard_of) + 1
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for k in range(n):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for e, s in zip(plan, shard_of):
            if s == k:
                tensors.update(_materialise(e, g, dtype, mxfp4))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
