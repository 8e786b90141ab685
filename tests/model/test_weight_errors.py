"""Malformed checkpoints: the loader raises one `CheckpointError` (or `ConfigError`) naming every
offender (missing, unexpected, duplicated, mis-shaped, wrong-dtype tensors; index and config
errors), in a fixed order across the read, map and validate phases."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from deltaserve.model import CheckpointError, ConfigError, load_model
from tests.model.test_weights import K3L, ckpts, write_single  # noqa: F401 (ckpts: fixture)


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as err:
        load_model(path, progress=False)
    return str(err.value)


def broken(ckpts, tmp_path, edit, family="kimi_k3", mxfp4=False):
    return load_error(write_single(ckpts[(family, mxfp4)], tmp_path / "broken", edit))


def test_missing_tensors_are_all_named(ckpts, tmp_path):
    def edit(t):
        for k in (
            K3L + "0.self_attn.q_proj.weight",
            "language_model.model.norm.weight",
            K3L + "2.block_sparse_moe.experts.3.w2.weight",
            K3L + "4.block_sparse_moe.gate.e_score_correction_bias",
        ):
            del t[k]
        for k in [k for k in t if k.startswith(K3L + "1.block_sparse_moe.experts.") and ".w1." in k]:
            del t[k]  # every w1 of layer 1

    msg = broken(ckpts, tmp_path, edit)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
        "model.layers.2.block_sparse_moe.experts.3.w2",
        "model.layers.1.block_sparse_moe.experts.w1",
        "model.layers.4.block_sparse_moe.gate.e_score_correction_bias",
    ):
        assert name in msg, name


def test_unexpected_and_duplicated_tensors_are_all_named(ckpts, tmp_path):
    def edit(t):
        t[K3L + "0.self_attn.bogus.weight"] = torch.zeros(2)
        t[K3L + "0.block_sparse_moe.experts.0.w1.weight"] = torch.zeros(32, 32)  # layer 0 is dense
        t[K3L + "1.block_sparse_moe.experts.8.w3.weight"] = torch.zeros(32, 32)  # only 8 experts
        t["lm_head.weight"] = t["language_model.lm_head.weight"].clone()  # outside language_model.
        t["language_model.layers.2.input_layernorm.weight"] = t[K3L + "2.input_layernorm.weight"].clone()

    msg = broken(ckpts, tmp_path, edit)
    for name in (
        K3L + "0.self_attn.bogus.weight",
        "model.layers.0.block_sparse_moe.experts.0.w1",
        "model.layers.1.block_sparse_moe.experts.8.w3",
        "language_model.layers.2.input_layernorm.weight",
    ):
        assert name in msg, name
    assert re.search(r"(^|[ :,])lm_head\.weight", msg) and "duplicated" in msg


def test_wrong_shapes_and_bad_a_log_are_all_named(ckpts, tmp_path):
    def edit(t):
        emb = "language_model.model.embed_tokens.weight"
        t[emb] = t[emb].T.contiguous()
        t[K3L + "2.block_sparse_moe.experts.5.w1.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
        t[K3L + "0.self_attn.A_log"] = torch.zeros(1)  # fewer than 2 heads
        t[K3L + "1.self_attn.A_log"] = torch.ones(4)  # nonzero padding
        t[K3L + "3.self_attn.kv_b_proj.weight"] = torch.zeros(64, 31, dtype=torch.bfloat16)

    msg = broken(ckpts, tmp_path, edit)
    for name in (
        "language_model.model.embed_tokens.weight",
        "model.layers.2.block_sparse_moe.experts.5.w1",
        K3L + "0.self_attn.A_log",
        K3L + "1.self_attn.A_log",
        K3L + "3.self_attn.kv_b_proj.weight",
    ):
        assert name in msg, name
    assert "padding" in msg


def test_wrong_dtypes_are_named(ckpts, tmp_path):
    def edit(t):
        t[K3L + "1.post_attention_layernorm.weight"] = torch.ones(64, dtype=torch.int32)
        pre = K3L + "3.block_sparse_moe.experts.2.w2."
        t[pre + "weight_packed"] = t[pre + "weight_packed"].to(torch.int8)
        del t[K3L + "4.block_sparse_moe.experts.1.w3.weight_scale"]

    msg = broken(ckpts, tmp_path, edit, mxfp4=True)
    assert K3L + "1.post_attention_layernorm.weight" in msg and "int32" in msg
    assert "model.layers.3.block_sparse_moe.experts.2.w2" in msg and "uint8" in msg
    assert "model.layers.4.block_sparse_moe.experts.1.w3" in msg and "weight_scale" in msg


def test_index_errors(ckpts, tmp_path):
    src = ckpts[("kimi_linear", False)]
    path = tmp_path / "idx"
    shutil.copytree(src, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = load_error(path)
    assert "model.layers.9.ghost.weight" in msg and "shard" in msg
    (path / "model-00002-of-00002.safetensors").unlink()
    msg = load_error(path)
    assert "model-00002-of-00002.safetensors" in msg and "missing shard" in msg
    (path / "model.safetensors.index.json").write_text("{not json")
    assert "malformed index" in load_error(path)
    (path / "model.safetensors.index.json").unlink()
    assert "no model.safetensors" in load_error(path)


def test_config_errors_name_the_field(ckpts, tmp_path):
    src = ckpts[("kimi_k3", False)]
    cases = [
        (lambda c: c.update(model_type="deepseek_v3"), "model_type"),
        (lambda c: c["text_config"].pop("num_attention_heads"), "num_attention_heads"),
        (lambda c: c["text_config"]["linear_attn_config"].pop("kda_layers"), "kda_layers"),
        (lambda c: c.pop("text_config"), "text_config"),
    ]
    for i, (edit, field) in enumerate(cases):
        path = tmp_path / f"c{i}"
        shutil.copytree(src, path)
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=field):
            load_model(path, progress=False)


def test_every_phase_reports_into_one_exact_error(ckpts, tmp_path):
    """Problems found while reading (repeated name, index entry its shard lacks), mapping (no such
    parameter, bad expert) and validating (mis-shaped, non-floating, missing) form one error, its
    kinds in a fixed order."""
    path = tmp_path / "all"
    shutil.copytree(ckpts[("kimi_k3", False)], path)
    extra = {
        "language_model.layers.2.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        K3L + "0.self_attn.bogus.weight": torch.zeros(2),
        K3L + "1.post_attention_layernorm.weight": torch.ones(3),
        K3L + "1.input_layernorm.weight": torch.ones(64, dtype=torch.int32),
        K3L + "1.block_sparse_moe.experts.0.w1.weight": torch.zeros(3, 3, dtype=torch.bfloat16),
    }
    save_file(extra, str(path / "extra.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    del weight_map["language_model.model.norm.weight"]
    for name in [*extra, K3L + "9.ghost.weight"]:  # the extra shard is read last
        weight_map.pop(name, None)
        weight_map[name] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_error(path) == "\n".join(
        [
            f"checkpoint {path} does not match its config:",
            "missing tensors (1): model.norm.weight",
            f"unexpected tensors (1): {K3L}0.self_attn.bogus.weight",
            "duplicated tensors (1): language_model.layers.2.input_layernorm.weight"
            f" (same parameter as {K3L}2.input_layernorm.weight)",
            f"mis-shaped tensors (1): {K3L}1.post_attention_layernorm.weight: (3,) != expected (64,)",
            f"wrong-dtype tensors (1): {K3L}1.input_layernorm.weight: torch.int32 (expected a floating dtype)",
            "invalid expert tensors (1): model.layers.1.block_sparse_moe.experts.0.w1: (3, 3) != expected (32, 32)",
            f"absent from their shard tensors (1): {K3L}9.ghost.weight (index: extra.safetensors)",
        ]
    )
