"""`scripts/gpu_engine_check.py` can fail on bf16 (issue 44): a backend whose bf16 path is broken
(its RMSNorm's epsilon off in bf16 only, fp32 untouched) fails the check through its first-step KL
against the fp32 reference, while a correct one passes. Before the fix only fp32 mismatches
failed, so this broken backend passed (bf16 was reported, never judged). The backend stands in
for the Triton one (`DELTASERVE_TRITON=1` picks it), as on a GPU.

The device check's set-up (issue 44: no venv, no network there) is proven by
`scripts/gpu_dry_run.sh --setup-only`: an interpreter that sees only the lent image's
distributions installs the fetched wheels with pip --no-index and passes the deps check. It runs
where `scripts/fetch_gpu_wheels.sh --dest .whl-cpu` has fetched wheels for this python3 (skipped
otherwise: fetching needs the network)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltaserve.ops.backends import select
from deltaserve.ops.backends.torch import TorchOps
from deltaserve.tiny import make_tiny

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_engine_check.py"
CPU_WHEELS = ROOT / ".whl-cpu"


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
    monkeypatch.setattr(select, "triton_ops", lambda device: ops())
    monkeypatch.setenv("DELTASERVE_TRITON", "")  # the script sets it: restored (unset) after the test
    monkeypatch.delenv("DELTASERVE_TRITON")
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


@pytest.mark.skipif(not list(CPU_WHEELS.glob("*.whl")), reason="no wheels in .whl-cpu (scripts/fetch_gpu_wheels.sh)")
def test_dry_run_setup_needs_only_the_image_and_the_wheels(tmp_path):
    """The image-like interpreter installs every wheel offline, and the deps check finds the
    wheels' versions (not this machine's) and imports the server, the engine and Triton's ops."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", "scripts/gpu_dry_run.sh", "--setup-only"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pydantic = next(CPU_WHEELS.glob("pydantic-*.whl")).name.split("-")[1]
    assert re.search(rf"^  pydantic {re.escape(pydantic)}$", done.stdout, re.M) and "deps: ok" in done.stdout
    assert f"installed {len(list(CPU_WHEELS.glob('*.whl')))} wheels" in done.stdout
