"""AMX tile kernels (csrc/amx.c, the tile branch of csrc/moe_decode.c) against the PyTorch ops and
the GEMV kernels they stand in for at 9..64 rows (batched decode). Both accumulate in fp32 and
round once to bf16, so results agree to about one bf16 ulp. Skipped where the CPU, compiler or
kernel does not grant AMX tiles; `amx_uses` proves the tile path ran."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.model.fused import bound_ops, prepare_model
from deltaserve.model.moe_layer import GluMlp
from deltaserve.ops.activations import silu_and_mul, situ_and_mul
from deltaserve.ops.backends.torch import REFERENCE
from deltaserve.ops.moe import grouped_experts

from .test_cpu_kernels import check_linear_multi, linear, routed_case, ulps

NK = cpu_kernels.native()
pytestmark = pytest.mark.skipif(NK is None or not NK.amx, reason="AMX tiles unavailable")
BF = torch.bfloat16


@pytest.mark.parametrize("rows", [9, 16, 17, 40, 64, 100])
@pytest.mark.parametrize("k", [64, 1024])
def test_amx_linear_matches_f_linear(rows, k):
    x, ws, got = check_linear_multi(NK, rows, k, NK.amx_uses)
    if rows <= NK.multi_rows(k):
        assert torch.equal(linear(x, ws[0]), got[0])  # dispatch takes the tile path
    else:
        assert torch.equal(linear(x, ws[0]), F.linear(x, ws[0]))  # larger batches: oneDNN


def test_amx_linear_leaves_unaligned_widths_to_torch():
    x, w = torch.randn(12, 48).to(BF), torch.randn(64, 48).to(BF)
    assert NK.multi_rows(48) == cpu_kernels.MAX_ROWS
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("n, hot", [(5, 0), (40, 0), (90, 90), (300, 300)])
def test_amx_experts_match_gemv_kernel_and_reference(n, hot):
    (w1, w3, w2), dense, x, ids, wts = routed_case(n, torch.Generator().manual_seed(n))
    ids[:hot, 0] = 0  # expert 0 gets `hot` more pairs: chunks past one pass of 64
    act = functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0)
    ref = grouped_experts(x, ids, wts, *dense, act)
    before = NK.amx_uses()
    tiles_packed = NK.moe_experts(x, ids, wts, w1, w3, w2, cpu_kernels.ACT_SITU, 4.0, 25.0)
    tiles_dense = NK.moe_experts(x, ids, wts, *dense, cpu_kernels.ACT_SITU, 4.0, 25.0)
    assert NK.amx_uses() > before
    NK.set_amx(False)
    NK.set_tiles(False)  # not the AVX512-BF16 register tiles either: the GEMV kernels
    try:
        gemv = NK.moe_experts(x, ids, wts, w1, w3, w2, cpu_kernels.ACT_SITU, 4.0, 25.0)
    finally:
        NK.set_tiles(True)
        NK.set_amx(True)
    assert torch.equal(tiles_packed, tiles_dense)  # decode-then-tile == tiles straight from bf16
    assert ulps(tiles_packed, ref, ref) <= 2.0
    assert ulps(tiles_packed, gemv, ref) <= 2.0


@pytest.mark.parametrize(
    "act, beta, lbeta",
    [
        (cpu_kernels.ACT_SILU, 0.0, 0.0),
        (cpu_kernels.ACT_SITU, 4.0, 0.0),
        (cpu_kernels.ACT_SITU, 2.0, 8.0),
        (cpu_kernels.ACT_SITU, 4.0, 25.0),
    ],
)
def test_amx_experts_glu_per_activation_and_chunking(act, beta, lbeta):
    """Each (act, beta, lbeta) gets its own GLU table; 530 pairs on one expert split into three tile
    chunks (an odd last m-block), the rest into 2..15-pair chunks; tiles agree with the GEMV kernels."""
    (w1, w3, w2), dense, x, ids, wts = routed_case(530, torch.Generator().manual_seed(int(beta * 10 + lbeta)))
    ids[:, 0] = 0
    if act == cpu_kernels.ACT_SILU:
        fn = silu_and_mul
    else:
        fn = functools.partial(situ_and_mul, beta=beta, linear_beta=lbeta or None)
    ref = grouped_experts(x, ids, wts, *dense, fn)
    before = NK.amx_uses()
    tiles = NK.moe_experts(x, ids, wts, w1, w3, w2, act, beta, lbeta)
    assert NK.amx_uses() > before
    NK.set_amx(False)
    NK.set_tiles(False)
    try:
        gemv = NK.moe_experts(x, ids, wts, w1, w3, w2, act, beta, lbeta)
    finally:
        NK.set_tiles(True)
        NK.set_amx(True)
    assert ulps(tiles, ref, ref) <= 2.0
    assert ulps(tiles, gemv, ref) <= 2.0
    assert torch.equal(tiles, NK.moe_experts(x, ids, wts, w1, w3, w2, act, beta, lbeta))  # the cached table


def test_glu_mlp_runs_fused_on_tiles_up_to_amx_rows():
    cfg = SimpleNamespace(hidden_act="situ", situ_beta=4.0, situ_linear_beta=25.0)  # the fields GluMlp reads
    mlp = GluMlp(cfg, 128, 256).to(BF)
    gen = torch.Generator().manual_seed(3)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.data = (torch.randn(lin.weight.shape, generator=gen) * 0.05).to(BF)
    x = torch.randn(cpu_kernels.AMX_ROWS, 128, generator=gen).to(BF)
    prepare_model(mlp)
    before = NK.amx_uses()
    got = mlp(x)
    assert NK.amx_uses() > before
    with bound_ops(mlp, REFERENCE):
        ref = mlp(x)
    assert ulps(got, ref, ref) <= 2.0
