"""`deltaserve plan` = the engine (issue 44): a tiny K3 with its vision tower is planned, the
engine is built from the flags the plan prints (parsed by the engine's own parser), and the bytes
it holds (weights and prepared operands, the vision tower, the KV pools, a filled encoder cache)
match the plan's within 5 % each, the pools (prefix-cache checkpoint slots included) exactly.
Before the fix the plan counted no vision tower (10 % of these weights), no encoder cache, no
checkpoint slots, and printed no engine flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex

import numpy as np
import pytest
import torch
from PIL import Image

from deltaserve import LLM, SamplingParams
from deltaserve.cache.plan_engine import EngineSettings
from deltaserve.cli import main, plan_defaults
from deltaserve.engine.config import EngineConfig, add_engine_args
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.tiny import make_tiny

SIDE = 448  # 32 x 32 patches of 14 -> 256 projector rows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("plan_engine"), "kimi_k3", "tiny", seed=2)


def _bytes_held(*roots) -> int:
    """Bytes covered by every tensor reachable from `roots` (modules, their `prepared` operands,
    pools), overlapping views counted once: the union of their address ranges."""
    spans, seen = [], set()

    def walk(obj):
        if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bytes, torch.dtype)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta" and obj.numel():
                spans.append((obj.data_ptr(), obj.data_ptr() + obj.numel() * obj.element_size()))
        elif isinstance(obj, (list, tuple, set)):
            for x in obj:
                walk(x)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif type(obj).__module__.startswith(("deltaserve", "torch.nn")) and hasattr(obj, "__dict__"):
            walk(vars(obj))

    for root in roots:
        walk(root)
    total, end = 0, 0
    for lo, hi in sorted(spans):
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total


def _picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8))


def _plan(ckpt, capsys, *extra) -> dict:
    assert main(["plan", str(ckpt), "--max-model-len", "512", "--max-num-seqs", "2", *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _engine(ckpt, flags: str) -> LLM:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return LLM.from_config(EngineConfig.from_args(parser.parse_args(shlex.split(flags)), model=ckpt, progress=False))


def _close(got: int, want: int) -> bool:
    return abs(got - want) <= 0.05 * want


@pytest.mark.parametrize(
    "dtype, extra",
    [
        ("bfloat16", ["--memory-per-rank", "6000000", "--reserve-fraction", "0", "--enable-prefix-caching"]),
        ("float32", ["--enable-prefix-caching"]),  # no budget: the engine's default, MLA pages doubled
        ("float32", ["--memory-per-rank", "9000000", "--no-enable-prefix-caching"]),
    ],
)
def test_engine_allocates_what_the_plan_says(ckpt, capsys, dtype, extra):
    rows = ImageProcessor.from_pretrained(ckpt).num_tokens(SIDE, SIDE)
    image_bytes = rows * 64 * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    p = _plan(ckpt, capsys, "--dtype", dtype, "--encoder-cache-memory", str(4 * image_bytes), *extra)
    assert p["weights"]["vision"]["total"] > 0.05 * p["weights"]["total"]["per_rank"]
    llm = _engine(ckpt, p["engine_flags"])
    try:
        cache, layout = p["cache"], llm.layout
        assert (layout.num_pages, layout.num_slots, layout.num_checkpoint_slots) == (
            cache["mla_pages"],
            cache["live_slots"],
            cache["checkpoint_slots"],
        )
        assert (layout.num_checkpoint_slots > 0) == ("--enable-prefix-caching" in extra)
        pools = _bytes_held(llm.cache.mla, llm.cache.kda, llm.cache.ckpt_pool)
        assert pools == cache["bytes"]
        encoder = llm.engine.runner.encoder
        weights = _bytes_held(llm.model, encoder.vision)
        assert _close(weights, p["weights"]["total"]["per_rank"]), (weights, p["weights"]["total"])
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for seed in range(5):  # one image more than the cache keeps
            llm.generate({"prompt": "see <|media_pad|>", "multi_modal_data": {"image": _picture(seed)}}, params)
        assert encoder.bytes == p["encoder_cache"]["bytes"] == 4 * image_bytes
        assert _close(weights + pools + encoder.bytes, p["total_per_rank"])
    finally:
        llm.shutdown()


def test_plan_defaults_are_the_engines():
    assert plan_defaults() == EngineSettings()


def test_fp8_kv_cache_is_refused(ckpt, capsys):
    assert main(["plan", str(ckpt), "--kv-cache-dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "deltaserve plan: error: --kv-cache-dtype fp8: the engine has no fp8 KV cache" in err
