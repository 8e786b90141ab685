"""`config.json` of a tiny checkpoint, in the real Hugging Face form (spec/model.md §1, §16):
Kimi-Linear flat, K3 nested as `text_config` + `vision_config`; MXFP4 checkpoints carry the
compressed-tensors `quantization_config` that marks routed experts only."""

from __future__ import annotations

from ..ops.mxfp4 import GROUP_SIZE
from .presets import VISION, Dims
from .tokenizer import EOS_NAME


def _quantization_config() -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": GROUP_SIZE,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "uint8",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "mxfp4-pack-quantized",
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
    }


def _text_config(family: str, d: Dims, ids: dict, mxfp4: bool, dtype_name: str) -> dict:
    k3 = family == "kimi_k3"
    lin = {"num_heads": d.kda_heads, "head_dim": d.kda_head_dim, "short_conv_kernel_size": 4}
    if k3:
        lin.update(use_full_rank_gate=True, gate_lower_bound=-5.0)
    lin.update(kda_layers=d.kda_layers, full_attn_layers=d.full_attn_layers)
    cfg = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "rms_norm_eps": 1e-5,
        "num_attention_heads": d.mla_heads,
        "num_key_value_heads": d.mla_heads,
        "q_lora_rank": d.q_lora_rank,
        "kv_lora_rank": d.kv_lora_rank,
        "qk_nope_head_dim": d.qk_nope,
        "qk_rope_head_dim": d.qk_rope,
        "v_head_dim": d.v_head,
        "mla_use_nope": True,
        "rope_theta": 10000.0,
        "linear_attn_config": lin,
        "first_k_dense_replace": 1,
        "intermediate_size": d.intermediate,
        "moe_layer_freq": 1,
        "num_experts": d.experts,
        "num_experts_per_token": d.top_k,
        "num_shared_experts": d.shared,
        "moe_intermediate_size": d.moe_intermediate,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids[EOS_NAME[family]],
        "pad_token_id": ids["[PAD]"],
        "use_cache": True,
        "dtype": dtype_name,
    }
    if k3:
        cfg.update(
            mla_use_output_gate=True,
            routed_expert_hidden_size=d.latent,
            latent_moe_use_norm=True,
            topk_method="noaux_tc",
            routed_scaling_factor=1.0,
            hidden_act="situ",
            activation_situ_beta=4.0,
            activation_situ_linear_beta=25.0,
            attn_res_block_size=d.attn_res_block,
            max_position_embeddings=1 << 20,
        )
    else:
        # top-level head_dim as the real config has it: hidden/heads, deliberately no real width
        cfg.update(
            routed_scaling_factor=2.446,
            hidden_act="silu",
            rope_scaling=None,
            head_dim=d.hidden // d.mla_heads,
            model_max_length=1 << 20,
        )
    if mxfp4:
        cfg["quantization_config"] = _quantization_config()
    return cfg


def hf_config(family: str, d: Dims, ids: dict, mxfp4: bool, dtype_name: str, vision: bool = True) -> dict:
    """The `config.json` dict; `ids` are the named special token ids the tokenizer wrote; a K3
    without `vision` has no `vision_config`."""
    text = _text_config(family, d, ids, mxfp4, dtype_name)
    if family == "kimi_linear":
        return text
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        **({"vision_config": dict(VISION, text_hidden_size=d.hidden)} if vision else {}),
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "image_placeholder": "<|kimi_image_placeholder|>",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "tie_word_embeddings": False,
        "dtype": dtype_name,
    }
