"""`deltaserve plan` on the real K3 and Kimi-Linear-48B geometries (config.json only): exact
per-rank KDA state and MLA bytes from spec/serving.md §1.1 and §1.3, weights against the
checkpoint size of spec/model.md §15.1, the JSON form, and clean errors for bad layouts."""

import json

import pytest

from deltaserve.cache.plan import Layout, PlanError, check, parse_bytes, plan
from deltaserve.cache.plan_engine import EngineSettings, load_vision_config
from deltaserve.cli import main, plan_defaults
from deltaserve.model.config import ModelConfig
from deltaserve.tiny.hf_config import hf_config
from deltaserve.tiny.presets import Dims
from deltaserve.tiny.tokenizer import EOS_NAME

MiB = 2**20
K3 = Dims(
    hidden=7168,
    layers=93,
    vocab=163840,
    kda_heads=96,
    kda_head_dim=128,
    mla_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_head=128,
    intermediate=33792,
    experts=896,
    top_k=16,
    shared=2,
    moe_intermediate=3072,
    latent=3584,
    attn_res_block=12,
    shard_bytes=0,
    mxfp4=True,
)
KL = Dims(
    hidden=2304,
    layers=27,
    vocab=163840,
    kda_heads=32,
    kda_head_dim=128,
    mla_heads=32,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_head=128,
    intermediate=9216,
    experts=256,
    top_k=8,
    shared=1,
    moe_intermediate=1024,
    latent=None,
    attn_res_block=None,
    shard_bytes=0,
    mxfp4=False,
)


def _write(path, family: str, dims: Dims, **lin):
    ids = {"[BOS]": 163584, "[PAD]": 163839, "<|media_pad|>": 163605, EOS_NAME[family]: 163586}
    raw = hf_config(family, dims, ids, dims.mxfp4, "bfloat16")
    (raw["text_config"] if family == "kimi_k3" else raw)["linear_attn_config"].update(lin)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("plan") / "k3", "kimi_k3", K3)


@pytest.fixture(scope="module")
def k3(k3_dir):
    cfg = ModelConfig.from_pretrained(k3_dir)
    assert (len(cfg.kda_layer_ids), len(cfg.mla_layer_ids), cfg.quantization) == (69, 24, "mxfp4")
    return cfg


@pytest.fixture(scope="module")
def k3_vision(k3_dir):
    return load_vision_config(k3_dir)


@pytest.fixture(scope="module")
def kl(tmp_path_factory):
    cfg = ModelConfig.from_pretrained(_write(tmp_path_factory.mktemp("plan") / "kl", "kimi_linear", KL))
    assert (len(cfg.kda_layer_ids), len(cfg.mla_layer_ids)) == (20, 7)
    return cfg


def _kda(p):
    return p["kda_state_per_request"]["bytes"]


@pytest.mark.parametrize(
    "tp, state, exact, mib",
    [
        (1, "float32", 69 * (6_291_456 + 221_184), 428.6),
        (8, "float32", 56_171_520, 53.6),
        (16, "float32", 28_085_760, 26.8),
        (8, "bfloat16", 29_039_616, 27.7),
    ],
)
def test_k3_kda_state_per_request(k3, tp, state, exact, mib):
    p = plan(k3, Layout(tp=tp, state_dtype=state))
    assert _kda(p) == exact and round(exact / MiB, 1) == mib
    assert p["kda_state_per_request"]["heads_per_rank"] == 96 // tp


@pytest.mark.parametrize(
    "dtype, dcp, per_token, request_1m",
    [
        ("bfloat16", 1, 27_648, 27_648 * 2**20),
        ("float32", 1, 55_296, 55_296 * 2**20),
        ("bfloat16", 8, 3_456, 3_456 * 2**20),
        ("bfloat16", 4, 6_912, 6_912 * 2**20),
    ],
)
def test_k3_mla_bytes_per_token_divide_by_dcp(k3, dtype, dcp, per_token, request_1m):
    p = plan(k3, Layout(tp=8, dcp=dcp, dtype=dtype))
    assert p["mla_bytes_per_token"] == per_token
    row = p["fits"][-1]
    assert row["tokens"] == 1 << 20 and row["mla_bytes"] == request_1m
    assert row["request_bytes"] == request_1m + _kda(p)


def test_one_million_token_request_in_the_engines_bf16(k3):
    """spec §1.1 sizes fp8 (≈14.5 GB per rank); the engine's latent is bf16: twice that, /8 with DCP8."""
    assert round(plan(k3, Layout(tp=8))["fits"][-1]["mla_bytes"] / 1e9, 1) == 29.0
    assert round(plan(k3, Layout(tp=8, dcp=8))["fits"][-1]["mla_bytes"] / 1e9, 2) == 3.62


@pytest.mark.parametrize(
    "lay, message",
    [
        (Layout(tp=8, kv_dtype="fp8"), "--kv-cache-dtype fp8: the engine has no fp8 KV cache"),
        (Layout(kv_dtype="float32"), "keeps the KV cache in the model dtype (--dtype bfloat16)"),
    ],
)
def test_kv_dtypes_the_engine_cannot_allocate_are_refused(k3, lay, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(k3, lay)
    assert plan(k3, Layout(kv_dtype="bfloat16"))["layout"]["kv_cache_dtype"] == "bfloat16"


@pytest.mark.parametrize("tp, dcp", [(8, 4), (8, 8), (16, 8), (8, 1)])
def test_kda_state_falls_with_tp_only(k3, tp, dcp):
    """DCP ranks come out of TP and already hold different KDA heads: DCP shrinks MLA only."""
    k = plan(k3, Layout(tp=tp, dcp=dcp))["kda_state_per_request"]
    assert k == {"bytes": 449_372_160 // tp, "heads_per_rank": 96 // tp}


def test_dcp_must_divide_tp_and_ep_the_experts(k3):
    with pytest.raises(PlanError, match="must divide --tensor-parallel-size 2"):
        plan(k3, Layout(tp=2, dcp=8))
    with pytest.raises(PlanError, match="896 experts do not split over TP3"):
        check(k3, Layout(tp=3, ep=True))


def test_kimi_linear_per_request(kl):
    p = plan(kl, Layout())
    assert _kda(p) == 20 * (2_097_152 + 73_728) == 43_417_600 and round(_kda(p) / MiB, 1) == 41.4
    assert p["mla_bytes_per_token"] == 8_064
    assert round(p["weights"]["total"]["total"] / 2 / 1e9, 1) == 49.1  # bf16: spec §1.3 49.1B params


def test_k3_weights_match_the_checkpoint_and_shard(k3, k3_vision):
    w = plan(k3, Layout(tp=8), vision=k3_vision)["weights"]
    routed = 92 * 896 * 3 * 3072 * 3584
    assert w["routed_experts"]["total"] == routed * 17 // 32  # 4.25 bits per weight
    assert w["routed_experts"]["per_rank"] == w["routed_experts"]["total"] // 8
    assert w["embeddings"] == {"total": 2 * 163840 * 7168 * 2, "per_rank": 2 * 163840 * 7168 * 2 // 8}
    assert w["shared_experts"]["per_rank"] * 8 == w["shared_experts"]["total"] == 92 * 3 * 6144 * 7168 * 2
    # spec/model.md §15.1: 1453.7 GiB on disk, of which the vision tower is 0.447B bf16 params
    text = 1453.7 * 2**30 - 0.447e9 * 2
    assert abs((w["total"]["total"] - w["vision"]["total"]) / text - 1) < 1e-3
    assert w["vision"]["per_rank"] == w["vision"]["total"] > 0  # rank 0 holds the whole tower
    ep = plan(k3, Layout(tp=32, dcp=4, ep=True))
    assert ep["layout"]["experts_per_rank"] == 28
    assert ep["weights"]["routed_experts"]["per_rank"] == w["routed_experts"]["total"] * 28 // 896


def test_pool_split_and_requests_that_fit(k3, k3_vision):
    mem = 288 * 10**9
    p = plan(k3, Layout(tp=8), memory_per_rank=mem, max_model_len=200_000, vision=k3_vision)
    m, c = p["memory"], p["cache"]
    weights = p["weights"]["total"]["per_rank"]
    assert m["reserve"] == mem // 10 and m["encoder_cache"] == p["encoder_cache"]["bytes"] == 512 << 20
    assert m["pool"] == c["kv_cache_memory"] == mem - mem // 10 - weights - (512 << 20)
    assert 0 <= m["pool"] - c["bytes"] < c["mla_page_bytes"] and c["live_slots"] == 16
    assert p["total_per_rank"] == weights + (512 << 20) + c["bytes"]
    assert [r["tokens"] for r in p["fits"]] == [8192, 32768, 131072, 200_000]
    last = p["fits"][-1]
    assert last["request_bytes"] == 12_500 * 16 * 27_648 + 56_171_520
    assert last["pages_hold"] == c["mla_pages"] // 12_500 and last["requests"] == min(last["pages_hold"], 16) > 0
    assert p["fits"][0]["requests"] == 16 < p["fits"][0]["pages_hold"]
    short = plan(k3, Layout(tp=8), memory_per_rank=141 * 2**30)
    assert short["memory"]["pool"] < 0 and short["cache"] is None and {r["requests"] for r in short["fits"]} == {0}


def test_prefix_caching_takes_its_checkpoint_share(k3):
    on = plan(k3, Layout(tp=8), 288 * 10**9, 200_000)["cache"]  # the engine's default: on
    no_cache = EngineSettings(enable_prefix_caching=False)
    off = plan(k3, Layout(tp=8), 288 * 10**9, 200_000, engine=no_cache)["cache"]
    assert (
        off["checkpoint_slots"] == 0 and on["checkpoint_slots"] == int(0.25 * on["kv_cache_memory"]) // on["slot_bytes"]
    )
    assert on["mla_pages"] < off["mla_pages"]
    assert "--no-enable-prefix-caching" in plan(k3, Layout(), engine=no_cache)["engine_flags"]
    assert not any("prefix-caching" in f for f in plan(k3, Layout())["engine_flags"])


def test_cli_json_carries_the_same_numbers(k3, k3_dir, capsys):
    args = [
        "plan",
        str(k3_dir / "config.json"),
        "--tensor-parallel-size",
        "8",
        "--decode-context-parallel-size",
        "8",
        "--memory-per-rank",
        "288GB",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    want = plan(k3, Layout(8, 8), 288 * 10**9, vision=load_vision_config(k3_dir), engine_defaults=plan_defaults())
    assert out == json.loads(json.dumps(want))
    assert out["mla_bytes_per_token"] == 3_456 and out["kda_state_per_request"]["bytes"] == 56_171_520
    assert main(args[:-1]) == 0
    text = capsys.readouterr().out
    assert (
        "3,456 B per token per rank" in text
        and "engine flags: --dtype bfloat16" in text
        and "53.6 MiB per request per rank" in text
    )
    assert "TP8 = 8 ranks, DCP8 within" in text and "DCP8 splits MLA positions only" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tensor-parallel-size", "5"], "--tensor-parallel-size 5 does not divide the 96 KDA heads"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
        (["--max-model-len", "-5"], "--max-model-len must be >= 1, got -5"),
    ],
)
def test_bad_layouts_exit_2_with_a_message(k3_dir, capsys, extra, message):
    assert main(["plan", str(k3_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deltaserve plan: error: ") and message in err and "Traceback" not in err


def test_dcp_without_mla_layers_is_refused(tmp_path, capsys):
    d = _write(tmp_path / "all_kda", "kimi_linear", KL, kda_layers=list(range(1, 28)), full_attn_layers=[])
    assert main(["plan", str(d), "-tp", "2", "--decode-context-parallel-size", "2"]) == 2
    assert "this model has no MLA layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra", [["--kv-cache-dtype", "fp16"], ["--kv-state-dtype", "fp8"], ["--memory-per-rank", "12XB"]]
)
def test_bad_arguments_are_usage_errors(k3_dir, capsys, extra):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(k3_dir), *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "deltaserve plan: error: argument" in err and "Traceback" not in err


def test_parse_bytes():
    assert parse_bytes("141GiB") == 141 * 2**30 and parse_bytes("288 GB") == 288 * 10**9
    assert parse_bytes("1.5TiB") == 3 * 2**39 and parse_bytes("1073741824") == 2**30
    with pytest.raises(ValueError):
        parse_bytes("0GB")


def test_tier_sizes_count_checkpoints_and_tokens():
    from deltaserve.cache.plan_report import tiers

    p = {"kda_state_per_request": {"bytes": 1000}, "mla_bytes_per_token": 10}
    assert tiers(p, 10_000, None, 64) == {"host": {"bytes": 10_000, "checkpoints": 6, "mla_tokens": 1000}}


def test_wide_ep_splits_experts_over_every_replica_and_counts_the_all_to_all(k3, k3_dir, capsys):
    """DP32 x EP (TP 1 each): 28 of 896 experts per rank, the rest per replica as at TP1; each
    rank sends 2 x top-k latent rows per token per MoE layer, 31/32 of them off-rank, plus counts."""
    one, wide = plan(k3, Layout()), plan(k3, Layout(ep=True, dp=32))
    w, w1 = wide["weights"], one["weights"]
    assert wide["layout"]["experts_per_rank"] == 28 and wide["layout"]["ranks"] == 32
    assert w["routed_experts"]["per_rank"] == w1["routed_experts"]["total"] * 28 // 896
    assert w["attention_dense"] == w1["attention_dense"] and w["embeddings"] == w1["embeddings"]
    a = wide["all_to_all"]
    row = 3584 * 2  # the latent width in bf16
    assert (a["row_bytes"], a["bytes_per_token_per_layer"], a["moe_layers"]) == (row, 2 * 16 * row, 92)
    a2a = 16 * 92 * 2 * 16 * row * 31 // 32 + 92 * 896 * 8
    assert a["decode_step"] == {"tokens": 16, "tokens_per_rank": 16, "bytes": a2a, "tp_gather_bytes": 0}
    assert a["prefill_step"]["tokens"] == 2048
    assert one["all_to_all"] is None and plan(k3, Layout(dp=2))["all_to_all"] is None  # DP without EP
    args = ["plan", str(k3_dir), "--data-parallel-size", "32", "--enable-expert-parallel"]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["all_to_all"] == a
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "DP32 x TP1 = 32 ranks" in text and "28 of 896 experts per rank (wide EP over DP32 x TP1)" in text
    assert "all-to-all (wide EP over 32 ranks)" in text and "--data-parallel-size 32 --enable-expert-parallel" in text
    with pytest.raises(PlanError, match="896 experts do not split over DP3 x TP1 ranks"):
        check(k3, Layout(ep=True, dp=3))


def test_wide_ep_with_tp_inside_each_replica(k3, k3_dir, capsys):
    """DP16 x TP2 x EP: 28 of 896 experts on each of 32 ranks, attention split TP2 as plain TP2;
    each TP rank dispatches half its replica's tokens and sends its routed rows to the other."""
    tp2, wide = plan(k3, Layout(tp=2)), plan(k3, Layout(tp=2, ep=True, dp=16))
    w, w2 = wide["weights"], tp2["weights"]
    assert wide["layout"]["experts_per_rank"] == 28 and wide["layout"]["ranks"] == 32
    assert w["routed_experts"]["per_rank"] == w2["routed_experts"]["total"] * 28 // 896
    assert w["attention_dense"] == w2["attention_dense"] and w["embeddings"] == w2["embeddings"]
    a, row = wide["all_to_all"], 3584 * 2
    a2a = 8 * 92 * 2 * 16 * row * 31 // 32 + 92 * 896 * 8  # 16 decode tokens a replica, 8 per TP rank
    assert a["decode_step"] == {"tokens": 16, "tokens_per_rank": 8, "bytes": a2a, "tp_gather_bytes": 8 * row * 92}
    assert a["tensor_parallel_size"] == 2 and a["prefill_step"]["tokens_per_rank"] == 1024
    assert main(["plan", str(k3_dir), "-dp", "16", "-tp", "2", "--enable-expert-parallel"]) == 0
    text = capsys.readouterr().out
    assert "28 of 896 experts per rank (wide EP over DP16 x TP2)" in text and "TP2 inside a replica" in text
    with pytest.raises(PlanError, match="decode-context-parallel"):
        check(k3, Layout(tp=2, dcp=2, ep=True, dp=16))
