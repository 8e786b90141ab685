"""Tensor-parallel engines follow one another in one process (lifecycle_scenario.py, in a
subprocess: before the fix the second engine hung on the first one's process group for the
collective timeout, so a deadline turns that into a failure)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.model.experts import StackedExperts
from deltaserve.parallel import ParallelContext
from deltaserve.parallel.loading import read_padded_shard
from deltaserve.tiny import PRESETS, make_tiny

from .engine_fixtures import make_llm

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_engines_one_after_another_in_one_process(tmp_path):
    cmd = [sys.executable, "-m", "tests.parallel.lifecycle_scenario", str(tmp_path)]
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"an engine hung: {(e.stderr or b'')[-3000:]!r}")
    assert out.returncode == 0 and "LIFECYCLE OK" in out.stdout, out.stderr[-4000:]


@pytest.mark.parametrize("family, moe_weights", [("kimi_k3", "packed"), ("kimi_linear", "dequantized")])
def test_mxfp4_experts_padded_to_whole_groups_per_rank_generate_what_one_process_does(tmp_path, family, moe_weights):
    """moe_intermediate_size 96 over 2 ranks is 48 columns a rank, not whole 32-element groups:
    each rank holds 64, zero-padded (before the fix: the load failed on a shard error)."""
    path = _odd_mxfp4_checkpoint(tmp_path, family)
    opts = dict(moe_weights=moe_weights, max_model_len=512)
    with make_llm(path, **opts) as one:
        want, want_lp = _run(one)
    with make_llm(path, tp=2, **opts) as two:
        experts = [m for m in two.model.modules() if isinstance(m, StackedExperts)]
        assert experts and {(e.width, e.packed) for e in experts} == {(64, moe_weights == "packed")}
        got, got_lp = _run(two)
        memory = two.rank_memory
    assert got == want
    assert (got_lp - want_lp).abs().max() <= 1e-5 * max(1.0, want_lp.abs().max().item())
    assert memory[0]["weight_bytes"] == memory[1]["weight_bytes"]


def test_a_padded_shard_holds_whole_groups_and_zeros_past_the_tensor(tmp_path):
    """Three groups over four ranks: one group each for ranks 0-2, zeros for rank 3; packed bytes
    (16 a group) and scales (1) along the input dim, rows (32) along the output dim."""
    packed = torch.arange(2 * 48, dtype=torch.uint8).reshape(2, 48)
    scale = torch.arange(2 * 3, dtype=torch.uint8).reshape(2, 3) + 100
    rows = torch.randn(96, 4)
    save_file({"w2.weight_packed": packed, "w2.weight_scale": scale, "w1.weight": rows}, tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        for r in range(4):
            tp = ParallelContext(r, 4)
            got = [read_padded_shard(f, n, d, tp) for n, d in (("w2.weight_packed", 1), ("w2.weight_scale", 1))]
            got.append(read_padded_shard(f, "w1.weight", 0, tp))
            if r < 3:
                want = [packed[:, 16 * r : 16 * r + 16], scale[:, r : r + 1], rows[32 * r : 32 * r + 32]]
            else:
                want = [torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(32, 4)]
            for g, w in zip(got, want):
                assert torch.equal(g, w), r


def _run(llm):
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    outs = llm.generate([[5 + i for i in range(11)], [(7 * i) % 1900 + 30 for i in range(37)]], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, torch.tensor(lps)


def _odd_mxfp4_checkpoint(root: Path, family: str) -> Path:
    with pytest.MonkeyPatch.context() as m:
        preset = dataclasses.replace(PRESETS[(family, "tiny")], kda_heads=4, mla_heads=4, moe_intermediate=96)
        m.setitem(PRESETS, (family, "odd"), preset)
        return make_tiny(root / "odd", family, "odd", mxfp4=True, seed=3)
