"""Per-call kernel fallbacks are counted by (op, reason) and logged once (`ops.fallbacks`): the native
CPU backend's kernels outside their window run the reference (or decline to the layer's path), and
exactly those calls count; its designed dispatch (oneDNN GEMMs for large batches) does not. The
start-up line names what the loaded model's shapes leave to torch."""

from __future__ import annotations

import logging

import pytest
import torch

from deltaserve.kernels.cpu import MLA_MAX_HEADS, library
from deltaserve.ops import fallbacks
from deltaserve.ops.backends.cpu import CpuNativeOps
from deltaserve.ops.backends.select import describe
from deltaserve.ops.backends.torch import REFERENCE
from deltaserve.ops.operands import RouteSpec, ServedShapes

NK = library.native()
pytestmark = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")
BF16 = torch.bfloat16
PREPARED = object()  # the methods read no field of their plan before the window check
DECLINED = object()  # what `otherwise` answers: the backend declined its plan


@pytest.fixture
def ops() -> CpuNativeOps:
    return CpuNativeOps(NK)


def test_mla_decode_beyond_the_kernels_heads_counts_shape(ops):
    heads, rank, rope = MLA_MAX_HEADS + 8, 32, 16
    q = torch.randn(2, heads, 24, dtype=BF16)
    w_uk, w_uv = torch.randn(heads, 8, rank, dtype=BF16), torch.randn(heads, 8, rank, dtype=BF16)
    view = (torch.randn(6, rank + rope, dtype=BF16), torch.arange(6), torch.tensor([0, 3, 6]))
    before = fallbacks.snapshot()
    assert ops.mla_decode(q, w_uk, w_uv, view, rank, 0.1, PREPARED) is None
    assert fallbacks.since(before) == {("mla_decode", "shape"): 1}


def test_kda_decode_over_bf16_states_counts_cache_dtype(ops):
    h, d, width, n = 2, 16, 4, 3
    tails = torch.zeros(4, width - 1, 3 * h * d, dtype=BF16)
    view = (tails, torch.zeros(4, h, d, d, dtype=BF16), torch.arange(n))
    before = fallbacks.snapshot()
    assert ops.kda_decode(torch.randn(n, 32, dtype=BF16), PREPARED, view, lambda: DECLINED) is DECLINED
    assert fallbacks.since(before) == {("kda_decode", "cache_dtype"): 1}


def test_router_beyond_its_rows_counts_rows_and_matches_the_reference(ops):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(65, 32, generator=gen).to(BF16)
    gate = (torch.randn(16, 32, generator=gen) * 0.1).to(BF16)
    spec = RouteSpec(top_k=2)
    before = fallbacks.snapshot()
    weights, ids, _ = ops.route(x, gate, None, spec)
    assert fallbacks.since(before) == {("route", "rows"): 1}
    ref_w, ref_ids, _ = REFERENCE.route(x, gate, None, spec)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    ops.route(x[:8], gate, None, spec)  # inside the window: the kernel, nothing counted
    assert fallbacks.since(before) == {("route", "rows"): 1}


def test_designed_dispatch_and_empty_calls_are_not_fallbacks(ops):
    w = torch.randn(48, 32, dtype=BF16)
    before = fallbacks.snapshot()
    ops.linear(torch.randn(300, 32, dtype=BF16), w)  # oneDNN's GEMM by design past the GEMV/tile rows
    ops.linear(torch.randn(0, 32, dtype=BF16), w)
    assert fallbacks.since(before) == {}
    ops.linear(torch.randn(4, 32), w.float())  # fp32 operands: the kernel takes bf16 only
    assert fallbacks.since(before) == {("linear", "dtype"): 1}


def test_each_op_and_reason_is_logged_once(ops, caplog):
    x = torch.randn(3, 40).to(BF16).t()  # a transposed view: the norm kernel reads unit strides
    w = torch.ones(3, dtype=BF16)
    before = fallbacks.snapshot()
    with caplog.at_level(logging.INFO, logger="deltaserve.ops"):
        for _ in range(3):
            torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, ops.prepare_norm(w)), REFERENCE.rms_norm(x, w, 1e-6))
    assert fallbacks.since(before) == {("rms_norm", "layout"): 3}
    if ("rms_norm", "layout") not in before:  # the first of the pair in this process
        assert sum("op rms_norm runs its fallback path (layout" in r.message for r in caplog.records) == 1


def test_startup_line_names_what_the_models_shapes_leave_to_torch(ops):
    plain = ServedShapes(BF16, BF16, torch.float32, 8, 512, 64, 192, "sigmoid")
    assert "gathered rows" not in describe(ops, plain) and "states" not in describe(ops, plain)
    wide = ServedShapes(BF16, BF16, BF16, MLA_MAX_HEADS * 2, 512, 64, 192, "softplus")
    line = describe(ops, wide)
    assert f"{MLA_MAX_HEADS * 2} heads" in line and "gathered rows" in line
    assert "softplus gate on torch" in line and "fp32 states, not bfloat16" in line
    assert describe(
        ops, ServedShapes(torch.float32, torch.float32, torch.float32, 8, 512, 64, 192, "sigmoid")
    ).startswith("torch [float32 model]")
