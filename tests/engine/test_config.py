"""`EngineConfig`: one flag per field that round-trips, the CLI's defaults unchanged, frozen, and
`LLM(**kw)` equal to `LLM.from_config(EngineConfig(**kw))`."""

import argparse
import dataclasses

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.config import EngineConfig, add_engine_args, cli_fields, flag_dest, flag_name
from deltaserve.model.config import ModelConfig
from deltaserve.tiny import make_tiny
from tests.engine.test_engine import budget_for, random_prompts

# field -> (flag arguments, the config value they give); every value differs from the default
NON_DEFAULT = {
    "dtype": (["--dtype", "float32"], "float32"),
    "max_num_seqs": (["--max-num-seqs", "3"], 3),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "77"], 77),
    "page_size": (["--page-size", "8"], 8),
    "kv_cache_memory": (["--kv-cache-memory", "0.2"], 0.2),
    "max_model_len": (["--max-model-len", "300"], 300),
    "kv_state_dtype": (["--kv-state-dtype", "bfloat16"], "bfloat16"),
    "skip_tokenizer_init": (["--skip-tokenizer-init"], True),
    "seed": (["--engine-seed", "9"], 9),
    "device": (["--device", "meta"], "meta"),
    "num_threads": (["--threads", "2"], 2),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "prefix_match_unit": (["--prefix-match-unit", "32"], 32),
    "kda_checkpoint_policy": (["--kda-checkpoint-policy", "prompt-end,junction"], "prompt-end,junction"),
    "kda_checkpoint_interval": (["--kda-checkpoint-interval", "128"], 128),
    "checkpoint_fraction": (["--checkpoint-fraction", "0.5"], 0.5),
    "moe_weights": (["--moe-weights", "packed"], "packed"),
    "structured_thinking_budget": (["--structured-thinking-budget", "-1"], None),
    "encoder_cache_memory": (["--encoder-cache-memory", "1000"], 1000),
    "max_encoder_patches_per_step": (["--max-encoder-patches-per-step", "256"], 256),
    "max_image_patches_per_request": (["--max-image-patches-per-request", "5000"], 5000),
    "tensor_parallel_size": (["--tensor-parallel-size", "4"], 4),
    "enable_expert_parallel": (["--enable-expert-parallel"], True),
    "decode_context_parallel_size": (["--decode-context-parallel-size", "2"], 2),
    "distributed_init_method": (["--distributed-init-method", "tcp://h:1"], "tcp://h:1"),
    "nnodes": (["--nnodes", "2"], 2),
    "node_rank": (["--node-rank", "1"], 1),
    "distributed_timeout": (["--distributed-timeout", "5"], 5.0),
    "kv_offload_memory": (["--kv-offload-memory", "1GiB"], 1 << 30),
    "kv_disk_path": (["--kv-disk-path", "/tmp/kv"], "/tmp/kv"),
    "kv_disk_size": (["--kv-disk-size", "2GB"], 2 * 10**9),
    "kv_store": (["--kv-store", "mooncake://h:50051"], "mooncake://h:50051"),
    "kv_store_size": (["--kv-store-size", "1GiB"], 1 << 30),
    "speculative_config": (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        {"method": "ngram", "num_speculative_tokens": 3},
    ),
}

# the parsed defaults of the engine flags, written out: what the CLI has always defaulted to
CLI_DEFAULTS = dict(
    dtype="bfloat16",
    max_num_seqs=16,
    max_num_batched_tokens=2048,
    page_size=16,
    max_model_len=8192,
    kv_cache_memory=None,
    threads=None,
    moe_weights="auto",
    enable_prefix_caching=True,
    prefix_match_unit=64,
    kda_checkpoint_policy="default",
    kda_checkpoint_interval=None,
    structured_thinking_budget=1024,
    kv_state_dtype="float32",
    skip_tokenizer_init=False,
    engine_seed=0,
    device="cpu",
    checkpoint_fraction=0.25,
    encoder_cache_memory=512 << 20,
    max_encoder_patches_per_step=None,
    max_image_patches_per_request=270_000,
    tensor_parallel_size=1,
    enable_expert_parallel=False,
    decode_context_parallel_size=1,
    distributed_init_method=None,
    nnodes=1,
    node_rank=0,
    distributed_timeout=60.0,
    kv_offload_memory=None,
    kv_disk_path=None,
    kv_disk_size=None,
    kv_store=None,
    kv_store_size=None,
    speculative_config=None,
)


def parse(flags: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(flags)


def test_every_field_has_a_flag_that_round_trips():
    assert {f.name for f in cli_fields()} == set(NON_DEFAULT)
    # serve owns --data-parallel-size; a wide-EP replica's rank and rendezvous are set by its launcher
    no_flag = {"model", "progress", "data_parallel_size", "data_parallel_rank", "data_parallel_init_method"}
    assert {f.name for f in dataclasses.fields(EngineConfig)} - set(NON_DEFAULT) == no_flag
    for f in cli_fields():
        flags, value = NON_DEFAULT[f.name]
        assert flags[0] in (flag_name(f), "--no-" + flag_name(f)[2:]) and value != f.default, f.name
        got = EngineConfig.from_args(parse(flags), model="m", progress=False)
        cli_default = EngineConfig.from_args(parse([]), model="m", progress=False)
        assert got == dataclasses.replace(cli_default, **{f.name: value}), f.name
    every = sum((flags for flags, _ in NON_DEFAULT.values()), [])
    want = EngineConfig(model="m", progress=False, **{k: v for k, (_, v) in NON_DEFAULT.items()})
    assert EngineConfig.from_args(parse(every), model="m", progress=False) == want


def test_cli_defaults_are_unchanged():
    ns = vars(parse([]))
    assert ns == CLI_DEFAULTS
    assert {flag_dest(f) for f in cli_fields()} == set(CLI_DEFAULTS)
    cfg = EngineConfig.from_args(argparse.Namespace(model="m", **ns))
    assert cfg == EngineConfig(model="m", max_model_len=8192)
    assert EngineConfig.from_args(parse(["--kv-cache-memory", "1000"]), model="m").kv_cache_memory == 1000


def test_frozen_and_validated():
    cfg = EngineConfig(model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 2
    for bad in (
        dict(max_num_seqs=0),
        dict(page_size=0),
        dict(prefix_match_unit=0),
        dict(moe_weights="x"),
        dict(max_model_len=-1),
        dict(enable_prefix_caching=True, checkpoint_fraction=1.0),
        dict(kv_store="redis://h:1"),
        dict(kv_store="mooncake://h"),
        dict(kv_store="mooncake://h:1/x?y=1"),
    ):
        with pytest.raises(ValueError):
            EngineConfig(model="m", **bad)
    for tiers in (dict(kv_store="mooncake://h:1"), dict(kv_offload_memory=1 << 20)):
        with pytest.raises(ValueError, match="need tensor_parallel_size 1"):
            EngineConfig(model="m", tensor_parallel_size=2, decode_context_parallel_size=2, **tiers).check_parallel()


def test_llm_kwargs_and_from_config_agree(tmp_path):
    ckpt = make_tiny(tmp_path / "k3", family="kimi_k3", preset="tiny", seed=3)
    cfg = ModelConfig.from_pretrained(ckpt)
    kw = dict(
        dtype="float32",
        max_num_seqs=3,
        max_num_batched_tokens=19,
        page_size=4,
        max_model_len=64,
        kv_cache_memory=budget_for(cfg, 3, 40, 4),  # exact pages and live slots: no checkpoints
        enable_prefix_caching=False,
        progress=False,
    )
    prompts = random_prompts(cfg.vocab_size, [7, 23, 12], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = LLM(ckpt, **kw)
    b = LLM.from_config(EngineConfig(model=ckpt, **kw))
    assert a.config == b.config and a.layout == b.layout
    ids = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (a, b)]
    assert ids[0] == ids[1] and all(len(t) == 8 for t in ids[0])
