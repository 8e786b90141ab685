"""Hugging Face `config.json` -> `ModelConfig` for the two families (spec/model.md §1).

Kimi K3 (`model_type: kimi_k3`) nests its text fields under `text_config`; Kimi-Linear
(`model_type: kimi_linear`) is flat. Layer-type lists in the file are 1-based. A top-level
`head_dim` is ignored on purpose (it is neither the MLA nor the KDA width). Every problem is a
`ConfigError` that names the offending field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("kimi_k3", "kimi_linear")


class ConfigError(ValueError):
    """A config.json that deltaserve cannot serve faithfully."""


@dataclass(frozen=True)
class KdaConfig:
    num_heads: int
    head_dim: int
    conv_kernel: int
    full_rank_gate: bool  # K3: g_proj [P, D]; Kimi-Linear: low-rank g_a/g_b
    gate_lower_bound: float | None  # K3: sigmoid gate in (lb, 0); None: softplus gate

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MlaConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool
    latent_norm_eps: float = 1e-6  # upstream builds q_a/kv_a norms with the class default

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: [c_hat | k_rot]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    num_shared_experts: int
    intermediate_size: int
    latent_size: int | None  # K3 routed_expert_hidden_size; None: experts at hidden width
    latent_norm: bool
    num_expert_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float
    bias_in_weights: bool = False  # Moonshot remote-code Kimi-Linear gate (see ops.moe.route)


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # "kda" | "mla", 0-based
    moe_layers: tuple[bool, ...]  # True where the FFN is the MoE
    intermediate_size: int
    hidden_act: str  # "situ" | "silu"
    situ_beta: float | None
    situ_linear_beta: float | None
    attn_res_block_size: int | None
    kda: KdaConfig
    mla: MlaConfig
    moe: MoeConfig
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    quantization: str | None = None  # "mxfp4" or None
    media_placeholder_token_id: int | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **overrides: Any) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, **overrides)

    @classmethod
    def from_dict(cls, raw: dict, **overrides: Any) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError("config must be a JSON object")
        model_type = raw.get("model_type")
        if model_type == "kimi_k3":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("kimi_k3 config: missing object field 'text_config'")
            return _parse_text(text, "kimi_k3", raw, overrides)
        if model_type == "kimi_linear":
            return _parse_text(raw, "kimi_linear", raw, overrides)
        raise ConfigError(f"unsupported model_type {model_type!r}; expected one of {FAMILIES}")

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]


def _field(
    d: dict, key: str, kind: type | tuple, where: str, default: Any = ..., optional=False, minimum: int | None = 1
):
    """Typed lookup; ints must be >= minimum (None: any)."""
    if key not in d or (d[key] is None and optional):
        if default is ...:
            if optional:
                return None
            raise ConfigError(f"{where}: missing required field '{key}'")
        return default
    v = d[key]
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and kind in (int, float):
        raise ConfigError(f"{where}: field '{key}' must be {kind.__name__}, got bool")
    if not isinstance(v, kind):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: field '{key}' must be {name}, got {type(v).__name__}")
    if kind is int and minimum is not None and v < minimum:
        raise ConfigError(f"{where}: field '{key}' must be >= {minimum}, got {v}")
    return v


def _layer_types(lin: dict, n_layers: int, where: str) -> tuple[str, ...]:
    kda = _field(lin, "kda_layers", list, where)
    mla = _field(lin, "full_attn_layers", list, where)
    for key, ids in (("kda_layers", kda), ("full_attn_layers", mla)):
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n_layers]
        if bad:
            raise ConfigError(f"{where}: '{key}' holds entries outside 1..{n_layers} (1-based): {bad}")
    overlap = sorted(set(kda) & set(mla))
    missing = sorted(set(range(1, n_layers + 1)) - set(kda) - set(mla))
    if overlap or missing or len(kda) + len(mla) != n_layers:
        raise ConfigError(
            f"{where}: 'kda_layers' and 'full_attn_layers' must partition 1..{n_layers}"
            f" (overlap {overlap}, missing {missing})"
        )
    kda_set = set(kda)
    return tuple("kda" if i + 1 in kda_set else "mla" for i in range(n_layers))


def _eos(v: Any) -> int | None:
    if isinstance(v, list):
        return v[0] if v else None
    return v


def _kda_config(lin: dict, lwhere: str) -> KdaConfig:
    lower_bound = _field(lin, "gate_lower_bound", float, lwhere, optional=True)
    full_rank = _field(lin, "use_full_rank_gate", bool, lwhere, default=False)
    kda = KdaConfig(
        num_heads=_field(lin, "num_heads", int, lwhere),
        head_dim=_field(lin, "head_dim", int, lwhere),
        conv_kernel=_field(lin, "short_conv_kernel_size", int, lwhere, default=4),
        full_rank_gate=full_rank,
        gate_lower_bound=lower_bound,
    )
    if lower_bound is not None and lower_bound >= 0:
        raise ConfigError(f"{lwhere}: 'gate_lower_bound' must be negative, got {lower_bound}")
    return kda


def _mla_config(t: dict, where: str) -> MlaConfig:
    n_heads = _field(t, "num_attention_heads", int, where)
    n_kv = _field(t, "num_key_value_heads", int, where, default=n_heads)
    if n_kv != n_heads:
        raise ConfigError(
            f"{where}: 'num_key_value_heads' ({n_kv}) must equal 'num_attention_heads' ({n_heads}) for MLA"
        )
    return MlaConfig(
        num_heads=n_heads,
        q_lora_rank=_field(t, "q_lora_rank", int, where, optional=True),
        kv_lora_rank=_field(t, "kv_lora_rank", int, where),
        qk_nope_head_dim=_field(t, "qk_nope_head_dim", int, where),
        qk_rope_head_dim=_field(t, "qk_rope_head_dim", int, where),
        v_head_dim=_field(t, "v_head_dim", int, where),
        output_gate=_field(t, "mla_use_output_gate", bool, where, default=False),
    )


def _moe_config(t: dict, where: str, overrides: dict) -> tuple[MoeConfig, str]:
    """(the MoE config, the experts' activation)."""
    n_experts = _field(t, "num_experts", int, where)
    top_k = _field(t, "num_experts_per_token", int, where)
    if top_k > n_experts:
        raise ConfigError(f"{where}: 'num_experts_per_token' ({top_k}) exceeds 'num_experts' ({n_experts})")
    groups = _field(t, "num_expert_group", int, where, default=1)
    topk_group = _field(t, "topk_group", int, where, default=1)
    if n_experts % groups or topk_group > groups:
        raise ConfigError(
            f"{where}: 'num_expert_group' ({groups}) must divide 'num_experts' ({n_experts})"
            f" and be >= 'topk_group' ({topk_group})"
        )
    act = _field(t, "hidden_act", str, where)
    if act not in ("situ", "silu"):
        raise ConfigError(f"{where}: unsupported 'hidden_act' {act!r} (expected 'situ' or 'silu')")
    router_act = _field(t, "moe_router_activation_func", str, where, default="sigmoid")
    if router_act != "sigmoid":
        raise ConfigError(f"{where}: unsupported 'moe_router_activation_func' {router_act!r}")
    moe = MoeConfig(
        num_experts=n_experts,
        top_k=top_k,
        num_shared_experts=_field(t, "num_shared_experts", int, where, default=0, minimum=0),
        intermediate_size=_field(t, "moe_intermediate_size", int, where),
        latent_size=_field(t, "routed_expert_hidden_size", int, where, optional=True),
        latent_norm=_field(t, "latent_moe_use_norm", bool, where, default=False),
        num_expert_group=groups,
        topk_group=topk_group,
        renormalize=_field(t, "moe_renormalize", bool, where, default=True),
        routed_scaling_factor=_field(t, "routed_scaling_factor", float, where, default=1.0),
        bias_in_weights=bool(overrides.pop("router_bias_in_weights", False)),
    )
    return moe, act


def _quantization(t: dict, top: dict, where: str) -> str | None:
    qc = t.get("quantization_config") or top.get("quantization_config")
    if qc is None:
        return None
    fmt = qc.get("format") if isinstance(qc, dict) else None
    if fmt != "mxfp4-pack-quantized":
        raise ConfigError(
            f"{where}: unsupported 'quantization_config.format' {fmt!r} (expected 'mxfp4-pack-quantized')"
        )
    return "mxfp4"


def _parse_text(t: dict, family: str, top: dict, overrides: dict) -> ModelConfig:
    where = "text_config" if family == "kimi_k3" else "config"
    n_layers = _field(t, "num_hidden_layers", int, where)
    hidden = _field(t, "hidden_size", int, where)
    lin = _field(t, "linear_attn_config", dict, where)
    lwhere = f"{where}.linear_attn_config"
    layer_types = _layer_types(lin, n_layers, lwhere)
    if not _field(t, "mla_use_nope", bool, where, default=True):
        raise ConfigError(f"{where}: 'mla_use_nope' is false; only NoPE MLA exists in this family")
    kda = _kda_config(lin, lwhere)
    mla = _mla_config(t, where)
    first_dense = _field(t, "first_k_dense_replace", int, where, default=0, minimum=0)
    freq = _field(t, "moe_layer_freq", int, where, default=1)
    moe_layers = tuple(i >= first_dense and i % freq == 0 for i in range(n_layers))
    moe, act = _moe_config(t, where, overrides)

    situ_beta = situ_lin = None
    if act == "situ":
        situ_beta = _field(t, "activation_situ_beta", float, where)
        situ_lin = _field(t, "activation_situ_linear_beta", float, where, optional=True)
    block = _field(t, "attn_res_block_size", int, where, optional=True)
    if family == "kimi_k3" and block is None:
        raise ConfigError(f"{where}: kimi_k3 requires 'attn_res_block_size'")
    quant = _quantization(t, top, where)
    max_pos = t.get("max_position_embeddings") or t.get("model_max_length") or 1 << 20
    if overrides:
        raise ConfigError(f"unknown config overrides: {sorted(overrides)}")
    return ModelConfig(
        family=family,
        vocab_size=_field(t, "vocab_size", int, where),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        rms_norm_eps=_field(t, "rms_norm_eps", float, where, default=1e-5),
        layer_types=layer_types,
        moe_layers=moe_layers,
        intermediate_size=_field(t, "intermediate_size", int, where),
        hidden_act=act,
        situ_beta=situ_beta,
        situ_linear_beta=situ_lin,
        attn_res_block_size=block,
        kda=kda,
        mla=mla,
        moe=moe,
        bos_token_id=t.get("bos_token_id", top.get("bos_token_id")),
        eos_token_id=_eos(t.get("eos_token_id", top.get("eos_token_id"))),
        pad_token_id=t.get("pad_token_id", top.get("pad_token_id")),
        max_position_embeddings=int(max_pos),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        quantization=quant,
        media_placeholder_token_id=top.get("media_placeholder_token_id"),
    )
