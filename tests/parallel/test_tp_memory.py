"""A rank's memory at load is its shard plus a bounded overhead: each rank reads only its slices,
so a TP2 rank's peak RSS growth during load is its own weights, the checkpoint pages it maps while
reading (file-backed, at most the files' size) and a fixed `OVERHEAD`, and it sits well below one
process's growth for the whole model (measured in the same run)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from deltaserve.tiny import PRESETS, make_tiny

OVERHEAD = 128 << 20  # interpreter-side load overhead (imports, the meta model, buffers), stated
MIB = 1 << 20
# each measurement in a fresh interpreter: in a long-lived one, memory freed by earlier work is
# reused and the load's growth under-counts
MEASURE = """
import json, sys
from deltaserve import LLM
opts = dict(tensor_parallel_size=int(sys.argv[2]), num_threads=1, skip_tokenizer_init=True, max_model_len=256)
with LLM(sys.argv[1], "float32", progress=False, **opts) as llm:
    print(json.dumps(llm.rank_memory))
"""


def _rank_memory(path, tp: int) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(tp)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rank_peak_rss_at_load_is_its_shard_plus_a_bounded_overhead(tmp_path, monkeypatch):
    big = dataclasses.replace(
        PRESETS[("kimi_k3", "tiny")],
        hidden=256,
        kda_heads=4,
        mla_heads=4,
        experts=16,
        moe_intermediate=512,
        latent=256,
        intermediate=1024,
        shard_bytes=16 << 20,
    )
    monkeypatch.setitem(PRESETS, ("kimi_k3", "mem"), big)
    path = make_tiny(tmp_path / "mem", "kimi_k3", "mem", seed=1)
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    (whole,) = _rank_memory(path, 1)
    ranks = _rank_memory(path, 2)
    assert len(ranks) == 2
    grow_whole = whole["rss_peak_load"] - whole["rss_before_load"]
    assert whole["weight_bytes"] > 4 * file_bytes // 3 > 40 * MIB  # fp32 weights from a bf16 file
    for r in ranks:
        grow = r["rss_peak_load"] - r["rss_before_load"]
        assert r["weight_bytes"] * 2 < whole["weight_bytes"] * 1.1
        assert grow <= r["weight_bytes"] + file_bytes + OVERHEAD, (grow / MIB, r)
        assert grow <= grow_whole - 0.35 * whole["weight_bytes"], (grow / MIB, grow_whole / MIB)
