"""`make_tiny` writes the real Hugging Face layout: file names, tensor names/dtypes/shapes of
spec/model.md §15.2-15.3, MXFP4 packing, sharding and index, determinism, tokenizer files that
tiktoken loads, and (Kimi-Linear) a checkpoint `transformers` loads with no missing keys."""

import hashlib
import json
import re

import pytest
import torch
from safetensors import safe_open

from deltaserve.cli import main
from deltaserve.model.config import ModelConfig
from deltaserve.ops.mxfp4 import mxfp4_decode
from deltaserve.tiny import make_tiny

K3 = "language_model.model.layers."
KIMI_PAT = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


def tensors(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / fname), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "k3": make_tiny(root / "k3", "kimi_k3", seed=5),
        "k3_mx": make_tiny(root / "k3_mx", "kimi_k3", mxfp4=True, seed=5),
        "kl": make_tiny(root / "kl", "kimi_linear", seed=5),
    }


@pytest.mark.parametrize("key", ["k3", "k3_mx", "kl"])
def test_files_shards_and_index(ckpts, key):
    path = ckpts[key]
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tiktoken.model",
        "tokenizer_config.json",
    } <= names
    assert ("chat_template.jinja" in names) == (key == "kl")
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) >= 2
    assert all(re.fullmatch(rf"model-{i + 1:05d}-of-{len(shards):05d}\.safetensors", n) for i, n in enumerate(shards))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    held, total = {}, 0
    for fname in shards:
        with safe_open(str(path / fname), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                held[k] = fname
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == held
    assert index["metadata"]["total_size"] == total


def test_k3_names_dtypes_shapes(ckpts):
    t = tensors(ckpts["k3"])
    cfg = ModelConfig.from_pretrained(ckpts["k3"])
    assert cfg.layer_types == ("kda", "kda", "kda", "mla", "mla")
    shapes = {
        "language_model.model.embed_tokens.weight": ((2048, 64), torch.bfloat16),
        "language_model.lm_head.weight": ((2048, 64), torch.bfloat16),
        "language_model.model.norm.weight": ((64,), torch.bfloat16),
        "language_model.model.output_attn_res_proj.weight": ((1, 64), torch.bfloat16),
        "language_model.model.output_attn_res_norm.weight": ((64,), torch.bfloat16),
        K3 + "0.mlp.gate_proj.weight": ((192, 64), torch.bfloat16),
        K3 + "0.self_attn.q_conv1d.weight": ((64, 1, 4), torch.float32),
        K3 + "0.self_attn.f_a_proj.weight": ((32, 64), torch.bfloat16),
        K3 + "0.self_attn.f_b_proj.weight": ((64, 32), torch.bfloat16),
        K3 + "0.self_attn.b_proj.weight": ((2, 64), torch.bfloat16),
        K3 + "0.self_attn.g_proj.weight": ((64, 64), torch.bfloat16),
        K3 + "0.self_attn.dt_bias": ((64,), torch.float32),
        K3 + "0.self_attn.A_log": ((4,), torch.float32),
        K3 + "0.self_attn.o_norm.weight": ((32,), torch.float32),
        K3 + "2.mlp_res_proj.weight": ((1, 64), torch.bfloat16),
        K3 + "2.self_attention_res_norm.weight": ((64,), torch.bfloat16),
        K3 + "3.self_attn.q_a_proj.weight": ((32, 64), torch.bfloat16),
        K3 + "3.self_attn.q_a_layernorm.weight": ((32,), torch.bfloat16),
        K3 + "3.self_attn.q_b_proj.weight": ((48, 32), torch.bfloat16),
        K3 + "3.self_attn.kv_a_proj_with_mqa.weight": ((40, 64), torch.bfloat16),
        K3 + "3.self_attn.kv_a_layernorm.weight": ((32,), torch.bfloat16),
        K3 + "3.self_attn.kv_b_proj.weight": ((64, 32), torch.bfloat16),
        K3 + "4.self_attn.g_proj.weight": ((32, 64), torch.bfloat16),
        K3 + "4.self_attn.o_proj.weight": ((64, 32), torch.bfloat16),
        K3 + "1.block_sparse_moe.gate.weight": ((8, 64), torch.bfloat16),
        K3 + "1.block_sparse_moe.gate.e_score_correction_bias": ((8,), torch.float32),
        K3 + "1.block_sparse_moe.routed_expert_down_proj.weight": ((32, 64), torch.bfloat16),
        K3 + "1.block_sparse_moe.routed_expert_norm.weight": ((32,), torch.bfloat16),
        K3 + "1.block_sparse_moe.routed_expert_up_proj.weight": ((64, 32), torch.bfloat16),
        K3 + "1.block_sparse_moe.experts.7.w1.weight": ((32, 32), torch.bfloat16),
        K3 + "4.block_sparse_moe.shared_experts.down_proj.weight": ((64, 64), torch.bfloat16),
        "vision_tower.encoder.blocks.1.wqkv.weight": ((144, 32), torch.bfloat16),  # q, k, v of 48 each
        "mm_projector.proj.2.weight": ((64, 128), torch.bfloat16),
    }
    for name, (shape, dtype) in shapes.items():
        assert tuple(t[name].shape) == shape and t[name].dtype == dtype, name
    a_log = t[K3 + "0.self_attn.A_log"]
    assert (a_log[2:] == 0).all() and (a_log[:2] != 0).all()
    assert K3 + "3.self_attn.q_proj.weight" not in t and K3 + "0.block_sparse_moe.gate.weight" not in t
    assert not any(k.startswith("model.") or k.startswith("lm_head") for k in t)


def test_k3_mxfp4_packing_equals_bf16_variant(ckpts):
    bf16, mx = tensors(ckpts["k3"]), tensors(ckpts["k3_mx"])
    pre = K3 + "2.block_sparse_moe.experts.5."
    assert mx[pre + "w1.weight_packed"].shape == (32, 16) and mx[pre + "w1.weight_packed"].dtype == torch.uint8
    assert mx[pre + "w1.weight_scale"].shape == (32, 1) and mx[pre + "w1.weight_scale"].dtype == torch.uint8
    assert mx[pre + "w2.weight_packed"].shape == (32, 16) and pre + "w2.weight" not in mx
    for name, w in bf16.items():
        if ".experts." in name:
            base = name[: -len(".weight")]
            got = mxfp4_decode(mx[base + ".weight_packed"], mx[base + ".weight_scale"], torch.bfloat16)
            assert torch.equal(got, w), name
        else:
            assert torch.equal(mx[name], w), name
    text = json.loads((ckpts["k3_mx"] / "config.json").read_text())["text_config"]
    qc = text["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "quantization_config" not in json.loads((ckpts["k3"] / "config.json").read_text())["text_config"]


def test_kimi_linear_names_dtypes_shapes(ckpts):
    t = tensors(ckpts["kl"])
    raw = json.loads((ckpts["kl"] / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_types == ("kda", "kda", "kda", "mla", "kda", "mla")
    assert raw["head_dim"] not in (32, 24, 16, 8) and raw["q_lora_rank"] is None
    assert "gate_lower_bound" not in raw["linear_attn_config"]
    shapes = {
        "model.embed_tokens.weight": ((2048, 96), torch.bfloat16),
        "lm_head.weight": ((2048, 96), torch.bfloat16),
        "model.layers.0.self_attn.A_log": ((1, 1, 2, 1), torch.float32),
        "model.layers.0.self_attn.dt_bias": ((64,), torch.float32),
        "model.layers.0.self_attn.g_a_proj.weight": ((32, 96), torch.bfloat16),
        "model.layers.0.self_attn.g_b_proj.weight": ((64, 32), torch.bfloat16),
        "model.layers.4.self_attn.k_conv1d.weight": ((64, 1, 4), torch.bfloat16),
        "model.layers.3.self_attn.q_proj.weight": ((48, 96), torch.bfloat16),
        "model.layers.5.self_attn.kv_b_proj.weight": ((64, 32), torch.bfloat16),
        "model.layers.5.self_attn.o_proj.weight": ((96, 32), torch.bfloat16),
        "model.layers.2.block_sparse_moe.experts.0.w1.weight": ((32, 96), torch.bfloat16),
        "model.layers.2.block_sparse_moe.experts.0.w2.weight": ((96, 32), torch.bfloat16),
        "model.layers.2.block_sparse_moe.shared_experts.up_proj.weight": ((32, 96), torch.bfloat16),
    }
    for name, (shape, dtype) in shapes.items():
        assert tuple(t[name].shape) == shape and t[name].dtype == dtype, name
    assert not any(k.startswith(("language_model.", "vision_tower.")) for k in t)
    assert "model.layers.3.self_attn.g_proj.weight" not in t
    assert "model.layers.1.block_sparse_moe.routed_expert_norm.weight" not in t


def test_deterministic_in_seed(ckpts, tmp_path):
    def digest(path):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.glob("*.safetensors")}

    assert digest(make_tiny(tmp_path / "again", "kimi_k3", seed=5)) == digest(ckpts["k3"])
    other = tensors(make_tiny(tmp_path / "other", "kimi_k3", seed=6))
    ref = tensors(ckpts["k3"])
    assert not torch.equal(
        other["language_model.model.embed_tokens.weight"], ref["language_model.model.embed_tokens.weight"]
    )


def test_init_gives_meaningful_decays(ckpts):
    t = tensors(ckpts["k3"])
    a, dt = t[K3 + "0.self_attn.A_log"][:2], t[K3 + "0.self_attn.dt_bias"]
    g = -5.0 * torch.sigmoid(torch.exp(a).repeat_interleave(32) * dt)  # f = 0
    assert (g < -1e-3).all() and (g > -2.0).all()
    kl = tensors(ckpts["kl"])
    a, dt = kl["model.layers.0.self_attn.A_log"].flatten(), kl["model.layers.0.self_attn.dt_bias"]
    g = -torch.exp(a).repeat_interleave(32) * torch.nn.functional.softplus(dt)
    assert (g < -1e-4).all() and (g > -3.0).all()


@pytest.mark.parametrize("key,eos", [("k3", "<|end_of_msg|>"), ("kl", "<|im_end|>")])
def test_tokenizer_files(ckpts, key, eos, tmp_path, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    path = ckpts[key]
    ranks = load_tiktoken_bpe(str(path / "tiktoken.model"))
    assert sorted(ranks.values()) == list(range(1792))
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    named = {int(i): v["content"] for i, v in tok_cfg["added_tokens_decoder"].items()}
    assert all(v["special"] for v in tok_cfg["added_tokens_decoder"].values())
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(1792, 2048)}
    assert len(specials) == 256 and tok_cfg["tokenizer_class"] == "TikTokenTokenizer"
    assert specials["[BOS]"] == 1792 and specials["[EOS]"] == 1793 and specials[eos] == 1794
    assert specials["<|media_pad|>"] == 1813 and specials["[UNK]"] == 2046 and specials["[PAD]"] == 2047
    assert tok_cfg["eos_token"] == "[EOS]" and tok_cfg["bos_token"] == "[BOS]"
    if key == "k3":
        names = ("<|open|>", "<|close|>", "<|sep|>", "<|media_begin|>")
        assert [specials[n] for n in names] == [1795, 1796, 1797, 1810]
    else:
        assert [specials[n] for n in ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")] == [
            1795,
            1796,
            1802,
            1809,
        ]
    enc = tiktoken.Encoding("tiny", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)
    assert enc.n_vocab == 2048
    text = "Hello world, 你好世界! It's 12345 tokens.\n\n  done"
    ids = enc.encode(text)
    assert enc.decode(ids) == text and max(ids) < 1792
    assert enc.encode(eos, allowed_special="all") == [1794]
    assert enc.encode(eos, disallowed_special=()) != [1794]
    raw = json.loads((path / "config.json").read_text())
    text_cfg = raw.get("text_config", raw)
    gen = json.loads((path / "generation_config.json").read_text())
    assert text_cfg["eos_token_id"] == gen["eos_token_id"] == specials[eos]
    assert text_cfg["bos_token_id"] == specials["[BOS]"] and text_cfg["pad_token_id"] == specials["[PAD]"]
    assert text_cfg["vocab_size"] == enc.n_vocab
    if key == "k3":
        assert raw["media_placeholder_token_id"] == specials["<|media_pad|>"]


def test_kimi_linear_chat_template(ckpts):
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string((ckpts["kl"] / "chat_template.jinja").read_text())
    got = template.render(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], add_generation_prompt=True
    )
    assert got == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
        "<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "yo<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_kimi_linear_loads_in_transformers(ckpts):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpts["kl"], dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == "KimiLinearForCausalLM"
    assert model.config.layer_types[3] == model.config.layer_types[5] == "full_attention"


def test_cli_make_tiny(tmp_path, capsys):
    assert main(["make-tiny", "--family", "kimi_linear", "--out", str(tmp_path / "c"), "--seed", "1"]) == 0
    assert "model.safetensors.index.json" in capsys.readouterr().out
    assert ModelConfig.from_pretrained(tmp_path / "c").family == "kimi_linear"
