"""`bench.accounting` against a hand count of the tiny Kimi K3 preset (bf16 load).

Tiny K3 (tiny/presets.py): D=64, 5 layers (MLA at 0-based 3, 4; KDA at 0, 1, 2), vocab 2048,
KDA 2 heads x 32 (P=64, conv 4), MLA 2 heads, q/kv rank 32/32, nope 16, rope 8, v 16,
layer 0 dense MLP 192, layers 1-4 MoE: 8 experts x 32 (top 4, 2 shared), latent 32.
fp32 on disk (stays fp32): KDA conv1d, A_log, dt_bias, o_norm; router e_score_correction_bias.
"""

import pytest
import torch

from deltaserve.bench import accounting
from deltaserve.model import load_model
from deltaserve.tiny import make_tiny

D, V, P, HK, DK = 64, 2048, 64, 2, 32
PER_LAYER = 6 * D  # 2 layer norms, 2 AttnRes proj + norm pairs
KDA_BF16 = 3 * P * D + D * DK + DK * P + HK * D + P * D + D * P  # q/k/v, f_a, f_b, b, g, o
KDA_FP32 = 3 * P * 4 + HK + P + DK  # conv1d x3, A_log, dt_bias, o_norm
MLA_MATS = 32 * D + 2 * 24 * 32 + 40 * D + 2 * 32 * 32 + 2 * 16 * D + D * 2 * 16  # q_a q_b kv_a kv_b g o
MLA_BF16 = MLA_MATS + 32 + 32  # + q_a / kv_a layernorms
DENSE_MLP = 3 * 192 * D
MOE_MATS = 8 * D + 32 * D + D * 32 + 3 * (2 * 32) * D  # router, latent down/up, shared (width 64)
MOE_BF16, MOE_FP32 = MOE_MATS + 32, 8  # + latent norm; correction bias
TOP_BF16 = D + D + D  # final norm, output AttnRes proj + norm
ROUTED_PER_LAYER = 4 * 3 * 32 * 32  # top_k x (w1, w2, w3) of 32x32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=1)
    return load_model(out, dtype=torch.bfloat16, progress=False)


def test_decode_bytes_match_the_hand_count(model):
    bf16 = 5 * PER_LAYER + 3 * KDA_BF16 + 2 * MLA_BF16 + DENSE_MLP + 4 * MOE_BF16 + TOP_BF16
    fp32 = 3 * KDA_FP32 + 4 * MOE_FP32
    context = 100
    got = accounting.decode_bytes(model, context, kv_itemsize=2, state_itemsize=4)
    assert got["dense_weight_bytes"] == 2 * bf16 + 4 * fp32
    assert got["embedding_row_bytes"] == D * 2
    assert got["lm_head_bytes"] == V * D * 2
    assert got["routed_expert_bytes"] == 4 * ROUTED_PER_LAYER * 2
    assert got["mla_cache_bytes"] == 2 * context * (32 + 8) * 2
    assert got["kda_state_bytes"] == 3 * (HK * DK * DK * 4 + 3 * 3 * P * 2)
    parts = (
        "dense_weight_bytes",
        "embedding_row_bytes",
        "lm_head_bytes",
        "routed_expert_bytes",
        "mla_cache_bytes",
        "kda_state_bytes",
    )
    assert got["total_bytes"] == sum(got[k] for k in parts)


@pytest.mark.parametrize("L", [10, 64, 300])
def test_prefill_flops_match_the_hand_count(model, L):
    kda_mats = 3 * P * D + 3 * P * 4 + D * DK + DK * P + HK * D + P * D + D * P
    mats = 5 * 2 * D + 3 * kda_mats + 2 * MLA_MATS + DENSE_MLP + 4 * MOE_MATS + D
    got = accounting.prefill_flops(model, L)
    assert got["dense_flops"] == 2 * mats
    assert got["routed_expert_flops"] == 4 * ROUTED_PER_LAYER * 2
    assert got["lm_head_flops"] == pytest.approx(2 * V * D / L)
    assert got["mla_attention_flops"] == pytest.approx(2 * 2 * 2 * (24 + 16) * (L + 1) / 2)
    C = min(64, L)
    kda_head = 6 * C * DK + 4 * C * DK + C * C / 3 + 6 * DK * DK
    assert got["kda_flops"] == pytest.approx(3 * HK * kda_head)
    parts = ("dense_flops", "routed_expert_flops", "lm_head_flops", "mla_attention_flops", "kda_flops")
    assert got["total_flops"] == pytest.approx(sum(got[k] for k in parts))


def test_mxfp4_experts_count_at_their_stored_size(tmp_path):
    """Packed experts are 4.25 bits per weight, dequantized ones bf16: either way not more."""
    out = make_tiny(tmp_path / "q", family="kimi_k3", preset="tiny", mxfp4=True, seed=1)
    m = load_model(out, dtype=torch.bfloat16, progress=False)
    routed = accounting.decode_bytes(m, 1, kv_itemsize=2)["routed_expert_bytes"]
    assert 4 * ROUTED_PER_LAYER * 17 // 32 <= routed <= 4 * ROUTED_PER_LAYER * 2


def test_expected_experts_counts_distinct_choices():
    assert accounting.expected_experts(8, 4, 1) == pytest.approx(4)
    assert accounting.expected_experts(8, 4, 3) == pytest.approx(8 * (1 - 0.5**3))
    assert accounting.expected_experts(64, 8, 10**6) == pytest.approx(64)
    g = torch.Generator().manual_seed(0)  # a uniform draw agrees with the closed form
    picks = torch.rand(4000, 5, 16, generator=g).argsort(-1)[..., :4]  # 4000 trials of 5 tokens, 4 of 16
    distinct = torch.zeros(4000, 16).scatter_(1, picks.flatten(1), 1.0).sum(1).mean().item()
    assert distinct == pytest.approx(accounting.expected_experts(16, 4, 5), rel=0.01)
    with pytest.raises(ValueError):
        accounting.expected_experts(8, 4, 0)


@pytest.mark.parametrize("seqs", [1, 3])
def test_decode_step_matches_the_hand_count(model, seqs):
    bf16 = 5 * PER_LAYER + 3 * KDA_BF16 + 2 * MLA_BF16 + DENSE_MLP + 4 * MOE_BF16 + TOP_BF16
    fp32 = 3 * KDA_FP32 + 4 * MOE_FP32
    context = 100
    got = accounting.decode_step(model, seqs, context, kv_itemsize=2, state_itemsize=4)
    experts = 8 * (1 - (1 - 4 / 8) ** seqs)
    assert got["distinct_experts_per_layer"] == pytest.approx(experts)
    assert got["weight_bytes"] == 2 * bf16 + 4 * fp32 + V * D * 2
    assert got["routed_expert_bytes"] == pytest.approx(4 * 3 * 32 * 32 * 2 * experts)
    seq = D * 2 + 2 * context * (32 + 8) * 2 + 3 * (HK * DK * DK * 4 + 3 * 3 * P * 2)
    assert got["sequence_bytes"] == seqs * seq
    assert got["total_bytes"] == pytest.approx(got["weight_bytes"] + got["routed_expert_bytes"] + seqs * seq)
    kda_mats = 3 * P * D + 3 * P * 4 + D * DK + DK * P + HK * D + P * D + D * P
    mats = 5 * 2 * D + 3 * kda_mats + 2 * MLA_MATS + DENSE_MLP + 4 * MOE_MATS + D
    mla = 2 * 2 * 2 * ((32 + 8) + 32) * context  # 2 layers x 2 heads, absorbed: latent+rope scores, latent values
    kda = 3 * HK * 7 * DK * DK
    per_token = 2 * mats + 4 * ROUTED_PER_LAYER * 2 + 2 * V * D + mla + kda
    assert got["flops_per_token"] == per_token and got["total_flops"] == seqs * per_token
    if seqs == 1:  # one sequence reads what `decode_bytes` counts
        one = accounting.decode_bytes(model, context, kv_itemsize=2, state_itemsize=4)
        assert got["total_bytes"] == pytest.approx(one["total_bytes"])


def test_roofline_seconds_is_the_slower_of_memory_and_compute():
    assert accounting.roofline_seconds(2e9, 1e9, 10.0, 100.0) == pytest.approx(0.2)
    assert accounting.roofline_seconds(1e9, 5e10, 10.0, 100.0) == pytest.approx(0.5)
