"""`model.fused.prepare_model`: the backend is chosen once per model and the whole-block plans are
built at load, never on a request; a weight reload followed by `prepare_model` computes exactly
what a fresh load of those weights computes; `model/` selects no kernels."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

import deltaserve.model as model_pkg
from deltaserve import LLM, SamplingParams
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.model import load_model
from deltaserve.model.fused import bound_ops, prepare_model
from deltaserve.model.modules import OpsModule
from deltaserve.ops.backends.cpu import CpuNativeOps
from deltaserve.ops.backends.torch import REFERENCE
from deltaserve.tiny import make_tiny
from tests.kernel_calls import count_kernel_calls

NK = cpu_kernels.native()
needs_kernels = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")
PLANS = ("kda_block_plan", "mla_block_plan", "moe_block_plan", "stack_plan")


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3"), "kimi_k3", mxfp4=True, seed=4)


def test_model_selects_no_kernels():
    """No module of `model/` imports `kernels` or calls `native(`: layers only call their backend."""
    for path in Path(model_pkg.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert "kernels" not in (node.module or ""), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "native":
                pytest.fail(f"{path.name}:{node.lineno} calls native()")


def test_fp32_models_bind_the_reference(k3):
    model = load_model(k3, dtype=torch.float32, progress=False)
    assert model.ops is REFERENCE
    assert all(m.ops is REFERENCE for m in model.modules() if isinstance(m, OpsModule))


@needs_kernels
def test_plans_built_at_load_never_per_step(k3, monkeypatch, caplog):
    plans = count_kernel_calls(monkeypatch, PLANS)
    with caplog.at_level(logging.INFO, logger="deltaserve.engine.core.builder"):
        llm = LLM(
            k3,
            dtype="bfloat16",
            max_num_seqs=2,
            page_size=4,
            max_model_len=128,
            kv_cache_memory=16 * 2**20,
            progress=False,
        )
    assert isinstance(llm.model.ops, CpuNativeOps)
    assert all(m.ops is llm.model.ops for m in llm.model.modules() if isinstance(m, OpsModule))
    assert "kernel backend: cpu-native" in caplog.text and "moe" in caplog.text
    built = sum(plans.values())
    assert built > 0 and plans["moe_block_plan"] > 0 and plans["stack_plan"] == 1
    steps = count_kernel_calls(monkeypatch, ("decode_logits",))
    llm.generate(
        [list(range(300, 320)), list(range(40, 47))],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert sum(plans.values()) == built, "a plan was built while serving"
    assert steps["decode_logits"] > 0


@needs_kernels
def test_reload_then_prepare_equals_fresh_load(k3, tmp_path):
    """Weights copied in place (the plans keep pointing at the same storage, the fp32 copies go
    stale) and `prepare_model` again: logits equal those of the model loaded from those weights."""
    other = make_tiny(tmp_path / "other", "kimi_k3", mxfp4=True, seed=9)
    model = load_model(k3, dtype=torch.bfloat16, progress=False)
    fresh = load_model(other, dtype=torch.bfloat16, progress=False)
    ids = torch.arange(200, 230)
    before = model.forward_full(ids)
    with torch.no_grad():
        for name, t in fresh.state_dict().items():
            model.get_parameter(name).copy_(t) if name in dict(model.named_parameters()) else model.get_buffer(
                name
            ).copy_(t)
    prepare_model(model)
    after, expected = model.forward_full(ids), fresh.forward_full(ids)
    assert not torch.equal(before, expected)
    assert torch.equal(after, expected)


@needs_kernels
def test_bound_ops_restores_the_backend(k3):
    model = load_model(k3, dtype=torch.bfloat16, progress=False)
    ids = torch.arange(10, 40)
    native = model.forward_full(ids)
    with bound_ops(model, REFERENCE):
        assert model.model.layers[1].self_attn.prepared is None
        reference = model.forward_full(ids)
    assert isinstance(model.ops, CpuNativeOps)
    assert torch.equal(model.forward_full(ids), native)
    assert not torch.equal(native, reference)  # the two backends really differ in summation order
    assert float((native.float() - reference.float()).abs().mean()) < 0.03  # bf16 noise only
