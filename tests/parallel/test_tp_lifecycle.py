"""Tensor-parallel engines follow one another in one process (lifecycle_scenario.py, in a
subprocess: before the fix the second engine hung on the first one's process group for the
collective timeout, so a deadline turns that into a failure)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from deltaserve.model.config import ConfigError, ModelConfig
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


def test_mxfp4_experts_that_split_into_partial_groups_are_refused_naming_the_constraint(tmp_path):
    """moe_intermediate_size 96 over 2 ranks is 48 columns a rank, not whole 32-element groups:
    refused before any worker starts (before the fix: a bare shard error from deep in the load)."""
    path = _odd_mxfp4_checkpoint(tmp_path)
    cfg = ModelConfig.from_pretrained(path)
    want = "moe_intermediate_size 96 gives each rank 48 columns.*32-element.*multiple of 64"
    with pytest.raises(ConfigError, match=want):
        cfg.check_tensor_parallel(2)
    cfg.check_tensor_parallel(2, expert_parallel=True)  # whole experts per rank: no split
    cfg.check_tensor_parallel(3)  # 32 columns a rank
    with pytest.raises(ConfigError, match=want):
        make_llm(path, tp=2)


def _odd_mxfp4_checkpoint(root: Path) -> Path:
    with pytest.MonkeyPatch.context() as m:
        preset = dataclasses.replace(PRESETS[("kimi_linear", "tiny")], moe_intermediate=96)
        m.setitem(PRESETS, ("kimi_linear", "odd"), preset)
        return make_tiny(root / "odd", "kimi_linear", "odd", mxfp4=True, seed=3)
