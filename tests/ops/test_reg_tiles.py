"""AVX512-BF16 register tiles (csrc/tiles.c) behind the tile kernels where AMX does not run: the
batched-decode projections (9..64 rows), the fused experts' tile chunks with MXFP4 decoded in the
weight loads (decode and prefill), and the multi-row MXFP4 GEMV kernels of smaller chunks; against
the PyTorch ops and the GEMV kernels. Run on the `avx512` variant (`library.load`: built without
AMX, so AMX machines test it too); skipped where the CPU lacks AVX512-BF16. `tile_uses` proves the
tile path ran."""

from __future__ import annotations

import functools

import pytest
import torch

from deltaserve.kernels.cpu import build
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.ops.activations import silu_and_mul, situ_and_mul
from deltaserve.ops.backends.cpu_dense import FUSED_MAX_TOKENS, CpuDenseOps
from deltaserve.ops.backends.torch import TorchOps
from deltaserve.ops.moe import grouped_experts
from deltaserve.ops.operands import ExpertWeights, GluAct

from .test_cpu_kernels import check_linear_multi, routed_case, ulps

BF = torch.bfloat16
pytestmark = pytest.mark.skipif(
    build.find_compiler() is None or "avx512" not in build.cpu_isas(), reason="no AVX512-BF16 (or no C compiler)"
)


@pytest.fixture(scope="module")
def nk():
    k = cpu_kernels.load("avx512")
    assert k.isa == "avx512" and not k.amx and k.tiles and k.tile_kind == "avx512-bf16"
    return k


def _gemv(nk, fn):
    """fn() with the register tiles off: the GEMV kernels (or torch above their rows)."""
    nk.set_tiles(False)
    try:
        return fn()
    finally:
        nk.set_tiles(True)


@pytest.mark.parametrize("rows", [9, 16, 17, 40, 64, 100])
@pytest.mark.parametrize("k", [64, 1024])
def test_linear_multi_on_register_tiles(nk, rows, k):
    x, ws, got = check_linear_multi(nk, rows, k, nk.tile_uses)
    assert nk.multi_rows(k) == cpu_kernels.AMX_ROWS
    if rows <= cpu_kernels.AMX_ROWS:
        assert torch.equal(CpuDenseOps(nk).linear(x, ws[0]), got[0])  # dispatch takes the tile path


def test_tiles_off_leaves_batches_to_torch(nk):
    assert nk.multi_rows(48) == cpu_kernels.MAX_ROWS  # widths off the 32-grid never tile
    assert _gemv(nk, lambda: (nk.tiles, nk.tile_kind, nk.multi_rows(1024))) == (False, "none", cpu_kernels.MAX_ROWS)
    assert nk.tiles and nk.multi_rows(1024) == cpu_kernels.AMX_ROWS


@pytest.mark.parametrize("n, hot", [(5, 0), (40, 12), (90, 90), (300, 300)])
def test_experts_on_register_tiles(nk, n, hot):
    """Experts of 11+ pairs on tiles (300 hot pairs: past one chunk of 256), the rest on the GEMV kernels;
    packed and bf16 weights give bit-identical tiles (the same staged bf16 in the same order)."""
    (w1, w3, w2), dense, x, ids, wts = routed_case(n, torch.Generator().manual_seed(n))
    ids[:hot, 0] = 0
    act = functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0)
    ref = grouped_experts(x, ids, wts, *dense, act)
    before = nk.tile_uses()
    tiles_packed = nk.moe_experts(x, ids, wts, w1, w3, w2, cpu_kernels.ACT_SITU, 4.0, 25.0)
    tiles_dense = nk.moe_experts(x, ids, wts, *dense, cpu_kernels.ACT_SITU, 4.0, 25.0)
    assert (nk.tile_uses() > before) == (hot >= 11)
    gemv = _gemv(nk, lambda: nk.moe_experts(x, ids, wts, w1, w3, w2, cpu_kernels.ACT_SITU, 4.0, 25.0))
    assert torch.equal(tiles_packed, tiles_dense)
    assert ulps(tiles_packed, ref, ref) <= 2.0
    assert ulps(tiles_packed, gemv, ref) <= 2.0


@pytest.mark.parametrize(
    "act, beta, lbeta",
    [(cpu_kernels.ACT_SILU, 0.0, 0.0), (cpu_kernels.ACT_SITU, 4.0, 0.0), (cpu_kernels.ACT_SITU, 2.0, 8.0)],
)
@pytest.mark.parametrize("pairs", [3, 4, 5, 8, 10, 12, 20, 33])
def test_expert_chunk_sizes_per_activation(nk, act, beta, lbeta, pairs):
    """One expert with `pairs` pairs: up to 10 on the multi-row MXFP4 GEMV kernels (4 or 3 rows a pass),
    11 and more on tiles, but up to 8 pairs past the last whole m-block on the GEMV kernels (20 = one
    m-block + 4, 33 = two + 1; `tile_uses` counts m-blocks). Each against the reference with its GLU."""
    (w1, w3, w2), dense, x, ids, wts = routed_case(pairs, torch.Generator().manual_seed(pairs + int(beta)), k=2)
    ids[:, 0] = 0
    ids[:, 1] = 1 + torch.arange(pairs) % 7
    fn = (
        silu_and_mul
        if act == cpu_kernels.ACT_SILU
        else functools.partial(situ_and_mul, beta=beta, linear_beta=lbeta or None)
    )
    ref = grouped_experts(x, ids, wts, *dense, fn)
    m_blocks = {12: 1, 20: 1, 33: 2}.get(pairs, 0)
    for weights in ((w1, w3, w2), dense):
        before = nk.tile_uses()
        assert ulps(nk.moe_experts(x, ids, wts, *weights, act, beta, lbeta), ref, ref) <= 2.0
        assert nk.tile_uses() - before == m_blocks


def test_prefill_experts_run_fused_on_tiles(nk):
    """Above FUSED_MAX_TOKENS the backend keeps the fused kernel on tiles (no decode to bf16 + GEMM)."""
    n = FUSED_MAX_TOKENS + 36
    (w1, w3, w2), dense, x, ids, wts = routed_case(n, torch.Generator().manual_seed(7), e=4, k=2)
    ex, act = ExpertWeights(w1, w3, w2, BF), GluAct("situ", 4.0, 25.0)
    before = nk.tile_uses()
    got = CpuDenseOps(nk).experts(x, ids, wts, ex, act)
    assert nk.tile_uses() > before
    ref = TorchOps().experts(x, ids, wts, ExpertWeights(*dense), act)
    assert ulps(got, ref, ref) <= 2.0
