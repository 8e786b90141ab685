"""What `LLM(...)` does at start-up: default pool sizes capped by the workload (an explicit budget
as given), and the native kernel library built and loaded before any request."""

import argparse
import functools

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.cache.budget import plan_layout, workload_layout
from deltaserve.engine.config import EngineConfig, add_engine_args
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.tiny import make_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=0)


def test_default_pools_are_what_the_workload_can_use(ckpt):
    llm = LLM(ckpt, dtype="float32", max_num_seqs=3, max_model_len=200, enable_prefix_caching=False, progress=False)
    cfg, lay = llm.model.config, llm.layout
    assert lay == workload_layout(cfg, 3, 200, 16, lay.kv_dtype)
    assert (llm.cache.mla.num_pages, llm.cache.kda.num_slots, llm.cache.ckpt_pool) == (3 * 13, 3, None)
    assert llm.cache.mla.storage.nbytes == 3 * 13 * lay.page_bytes
    pre = LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=3,
        max_model_len=200,
        progress=False,
        enable_prefix_caching=True,
        prefix_match_unit=16,
    )
    assert (
        pre.cache.mla.num_pages == 2 * 3 * 13
        and pre.cache.ckpt_pool.num_slots
        == pre.layout.num_checkpoint_slots
        == workload_layout(cfg, 3, 200, 16, lay.kv_dtype, checkpoint_fraction=0.25).num_checkpoint_slots
    )


def test_explicit_budget_is_honoured(ckpt):
    llm = LLM(ckpt, dtype="float32", max_num_seqs=3, max_model_len=200, kv_cache_memory=10**7, progress=False)
    assert llm.layout == plan_layout(llm.model.config, 10**7, 3, 200, 16, llm.layout.kv_dtype, checkpoint_fraction=0.25)
    assert llm.layout.total_bytes <= 10**7 < llm.layout.total_bytes + llm.layout.page_bytes
    assert llm.cache.mla.num_pages > 3 * 13


def test_cli_default_leaves_the_budget_to_the_engine():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineConfig.from_args(p.parse_args([]), model="m").kv_cache_memory is None
    assert EngineConfig.from_args(p.parse_args(["--kv-cache-memory", "0.2"]), model="m").kv_cache_memory == 0.2
    assert EngineConfig.from_args(p.parse_args(["--kv-cache-memory", "1000"]), model="m").kv_cache_memory == 1000


def test_native_kernels_load_at_start_up_not_on_the_first_request(ckpt, monkeypatch):
    """A fresh per-process loader (the on-disk build may be cached, as in a second run)."""
    fresh = functools.lru_cache(maxsize=1)(cpu_kernels._load.__wrapped__)
    monkeypatch.setattr(cpu_kernels, "_load", fresh)
    assert not cpu_kernels.is_loaded()
    llm = LLM(ckpt, dtype="bfloat16", max_num_seqs=2, max_model_len=64, progress=False)
    assert cpu_kernels.is_loaded() and fresh.cache_info().misses == 1

    def build(*a):
        raise AssertionError("the native library was built during a request")

    monkeypatch.setattr(cpu_kernels, "_build", build)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert fresh.cache_info().misses == 1


def test_float32_engine_does_not_build_the_native_library(ckpt, monkeypatch):
    fresh = functools.lru_cache(maxsize=1)(cpu_kernels._load.__wrapped__)
    monkeypatch.setattr(cpu_kernels, "_load", fresh)
    LLM(ckpt, dtype="float32", max_num_seqs=2, max_model_len=64, progress=False)
    assert not cpu_kernels.is_loaded()
