"""`scripts/gpu_engine_check.py` can fail on bf16 (issue 44): a backend whose bf16 path is broken
(its RMSNorm's epsilon off in bf16 only, fp32 untouched) fails the check through its first-step KL
against the fp32 reference, while a correct one passes. Before the fix only fp32 mismatches
failed, so this broken backend passed (bf16 was reported, never judged). The backend stands in
for the Triton one (`DELTASERVE_TRITON=1` picks it), as on a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from deltaserve.ops import select
from deltaserve.ops.backend import TorchOps
from deltaserve.tiny import make_tiny

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu_engine_check.py"


class BrokenBf16(TorchOps):
    name = "broken-bf16"

    def rms_norm(self, x, w, eps, prepared=None):
        return super().rms_norm(x, w, 0.5 if x.dtype == torch.bfloat16 else eps, prepared)


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_engine_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.PROMPTS = mod.PROMPTS[:2]
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("gpucheck"), family="kimi_k3", preset="tiny", seed=17)


@pytest.mark.parametrize("ops, dtypes", [(TorchOps, ["bfloat16"]), (BrokenBf16, ["float32", "bfloat16"])])
def test_bf16_divergence_fails_the_check(check, ckpt, monkeypatch, capsys, ops, dtypes):
    monkeypatch.setattr(select.triton_backend, "triton_ops", lambda device: ops())
    monkeypatch.delenv("DELTASERVE_TRITON", raising=False)
    failures = check.check_family(ckpt, "kimi_k3", dtypes, "cpu", "triton", 1)
    out = capsys.readouterr().out
    assert ("bfloat16 cache=off: " + ops.name) in out
    if ops is BrokenBf16:  # fp32 equal (all the old check judged), bf16 beyond the tolerance
        assert "float32 cache=off: broken-bf16 on cpu" in out and "FAILED" not in out.split("bfloat16")[0]
        assert failures == 4 and out.count("(FAILED)") == 2
    else:
        assert failures == 0


def test_kl_and_first_token_rules(check):
    ref = torch.tensor([2.0, 1.0, 0.0])
    run = check.Run([[0]], [ref], "x")
    assert check.kl_div(ref, ref) == 0 and check.bf16_failures(run, run, run)[0] == 0
    flipped = check.Run([[1]], [torch.tensor([1.0, 2.0, 0.0])], "x")
    assert check.bf16_failures(run, run, flipped)[0] == 1  # another first token, a large KL
    assert check.bf16_failures(run, flipped, flipped)[0] == 0  # as far off as CPU's own bf16
