"""ModelConfig parsing of both families, and clear errors naming the field."""

import copy
import json

import pytest

from deltaserve.model.config import ConfigError, ModelConfig


def k3_config() -> dict:
    full = list(range(4, 93, 4)) + [93]
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "media_placeholder_token_id": 163605,
        "text_config": {
            "model_type": "kimi_linear",
            "hidden_size": 7168,
            "num_hidden_layers": 93,
            "vocab_size": 163840,
            "rms_norm_eps": 1e-5,
            "num_attention_heads": 96,
            "num_key_value_heads": 96,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "head_dim": 74,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "rope_theta": 10000,
            "linear_attn_config": {
                "num_heads": 96,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": True,
                "gate_lower_bound": -5.0,
                "full_attn_layers": full,
                "kda_layers": [i for i in range(1, 94) if i not in full],
            },
            "first_k_dense_replace": 1,
            "intermediate_size": 33792,
            "moe_layer_freq": 1,
            "num_experts": 896,
            "num_experts_per_token": 16,
            "num_shared_experts": 2,
            "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True,
            "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "moe_renormalize": True,
            "routed_scaling_factor": 1.0,
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "attn_res_block_size": 12,
            "bos_token_id": 163584,
            "eos_token_id": 163586,
            "pad_token_id": 163839,
            "max_position_embeddings": 1048576,
            "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
        },
    }


def kimi_linear_config() -> dict:
    full = [4, 8, 12, 16, 20, 24, 27]
    return {
        "model_type": "kimi_linear",
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "vocab_size": 163840,
        "rms_norm_eps": 1e-5,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "head_dim": 72,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "linear_attn_config": {
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, 28) if i not in full],
        },
        "first_k_dense_replace": 1,
        "intermediate_size": 9216,
        "moe_layer_freq": 1,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 1024,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "hidden_act": "silu",
        "eos_token_id": 163586,
        "model_max_length": 1048576,
    }


def test_k3_layer_pattern_and_fields():
    cfg = ModelConfig.from_dict(k3_config())
    assert cfg.family == "kimi_k3"
    assert cfg.mla_layer_ids == list(range(3, 92, 4)) + [92]  # 91 and 92 both MLA
    assert len(cfg.kda_layer_ids) == 69
    assert cfg.layer_types[91] == cfg.layer_types[92] == "mla"
    assert cfg.moe_layers[0] is False and all(cfg.moe_layers[1:])
    assert cfg.kda.gate_lower_bound == -5.0 and cfg.kda.full_rank_gate
    assert cfg.mla.qk_head_dim == 192 and cfg.mla.latent_dim == 576 and cfg.mla.latent_norm_eps == 1e-6
    assert cfg.moe.top_k == 16 and cfg.moe.latent_size == 3584 and cfg.moe.routed_scaling_factor == 1.0
    assert (cfg.situ_beta, cfg.situ_linear_beta, cfg.attn_res_block_size) == (4.0, 25.0, 12)
    assert cfg.quantization == "mxfp4" and cfg.eos_token_id == 163586
    assert cfg.media_placeholder_token_id == 163605


def test_kimi_linear_flat_and_ignores_top_level_head_dim():
    cfg = ModelConfig.from_dict(kimi_linear_config())
    assert cfg.family == "kimi_linear"
    assert cfg.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert cfg.kda.head_dim == 128 and cfg.mla.qk_head_dim == 192  # not the top-level 72
    assert cfg.kda.gate_lower_bound is None and not cfg.kda.full_rank_gate
    assert cfg.mla.q_lora_rank is None and not cfg.mla.output_gate
    assert cfg.attn_res_block_size is None and cfg.hidden_act == "silu"
    assert cfg.moe.routed_scaling_factor == 2.446 and cfg.max_position_embeddings == 1048576


def _mutate(base, path, value):
    d = copy.deepcopy(base)
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize(
    "path,value,needle",
    [
        (("model_type",), "llama", "model_type"),
        (("text_config",), KeyError, "text_config"),
        (("text_config", "hidden_size"), KeyError, "hidden_size"),
        (("text_config", "hidden_size"), "7168", "hidden_size"),
        (("text_config", "num_experts_per_token"), 1000, "num_experts_per_token"),
        (("text_config", "linear_attn_config", "kda_layers"), [1, 2, 3], "partition"),
        (("text_config", "linear_attn_config", "full_attn_layers"), [0, 4], "full_attn_layers"),
        (("text_config", "hidden_act"), "gelu", "hidden_act"),
        (("text_config", "attn_res_block_size"), KeyError, "attn_res_block_size"),
        (("text_config", "activation_situ_beta"), KeyError, "activation_situ_beta"),
        (("text_config", "num_key_value_heads"), 8, "num_key_value_heads"),
        (("text_config", "mla_use_nope"), False, "mla_use_nope"),
        (("text_config", "quantization_config"), {"format": "nvfp4"}, "quantization_config"),
        (("text_config", "linear_attn_config", "gate_lower_bound"), 1.0, "gate_lower_bound"),
    ],
)
def test_bad_k3_configs_name_the_field(path, value, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(_mutate(k3_config(), path, value))


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(kimi_linear_config()))
    assert ModelConfig.from_pretrained(tmp_path).num_hidden_layers == 27
    assert ModelConfig.from_pretrained(tmp_path, router_bias_in_weights=True).moe.bias_in_weights
