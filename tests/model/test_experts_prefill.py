"""The bf16 prefill path of the routed experts (`CpuNativeOps.grouped_experts`: gathered rows,
fused gate+up GEMM, native GLU and slot-order combination) against `ops.moe.grouped_experts`."""

import pytest
import torch

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.model.experts import StackedExperts
from deltaserve.model.fused import prepare_model
from deltaserve.ops.activations import situ_and_mul
from deltaserve.ops.backends.cpu import CpuNativeOps
from deltaserve.ops.backends.cpu_dense import FUSED_MAX_TOKENS
from deltaserve.ops.moe import grouped_experts
from deltaserve.ops.mxfp4 import mxfp4_decode, mxfp4_encode
from deltaserve.ops.operands import GluAct

NK = cpu_kernels.native()
pytestmark = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")
BF = torch.bfloat16
E, WIDTH, D, TOP_K = 6, 64, 96, 3


def _experts(packed: bool, gen: torch.Generator) -> tuple[StackedExperts, tuple]:
    mod = StackedExperts(E, WIDTH, D)
    dense = []
    for name in ("w1", "w3", "w2"):
        shape = getattr(mod, name).shape
        w = torch.randn(*shape, generator=gen) * 0.05
        enc = [mxfp4_encode(w[e]) for e in range(E)]
        w = torch.stack([mxfp4_decode(p, s, torch.float32) for p, s in enc]).to(BF)
        dense.append(w)
        if packed:
            mod.set_packed(name, torch.stack([p for p, _ in enc]), torch.stack([s for _, s in enc]), BF)
        else:
            getattr(mod, name).data = w
    prepare_model(mod, CpuNativeOps(NK))
    return mod, tuple(dense)


@pytest.mark.parametrize("path", ["gemm", "registers", "amx"])
@pytest.mark.parametrize("packed", [False, True])
def test_prefill_experts_match_grouped_experts(packed, path, monkeypatch):
    """Without tiles prefill batches take `grouped_experts`; on tiles (AMX, or AVX512-BF16 register
    tiles where AMX is off) the fused tile kernel."""
    if path == "amx" and not NK.amx:
        pytest.skip("AMX tiles unavailable")
    if path == "registers" and not NK.avx512_bf16:
        pytest.skip("AVX512-BF16 unavailable")
    gen = torch.Generator().manual_seed(3)
    mod, dense = _experts(packed, gen)
    n = 3 * FUSED_MAX_TOKENS + 5
    x = torch.randn(n, D, generator=gen).to(BF)
    ids = torch.randint(0, E - 1, (n, TOP_K), generator=gen)  # expert E-1 never chosen
    ids[:, 1] = (ids[:, 0] + 1) % (E - 1)
    ids[:, 2] = (ids[:, 0] + 2) % (E - 1)
    w = torch.rand(n, TOP_K, generator=gen)
    calls = []
    real = CpuNativeOps.grouped_experts
    monkeypatch.setattr(CpuNativeOps, "grouped_experts", lambda self, *a: calls.append(1) or real(self, *a))
    act = GluAct("situ", 4.0, 25.0)
    old_amx, old_tiles = NK.set_amx(path == "amx"), NK.set_tiles(path != "gemm")
    before = NK.tile_uses()
    try:
        got = mod(x, ids, w, act)
    finally:
        NK.set_tiles(old_tiles)
        NK.set_amx(old_amx)
    ref = grouped_experts(x, ids, w, *dense, act)
    if path != "gemm":
        assert not calls and NK.tile_uses() > before, "the tile path did not engage"
    else:
        assert calls, "the native prefill path did not engage"
    assert got.dtype == BF and got.shape == (n, D)
    # same products; the GLU may differ by one bf16 ulp in rare elements, oneDNN's K order too
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-3)
    assert (got == ref).float().mean() > 0.9


def test_moe_combine_is_the_slot_order_fp32_sum():
    gen = torch.Generator().manual_seed(5)
    n, k, d = 37, 4, 3000  # d spans two column blocks
    ys = torch.randn(n * k, d, generator=gen).to(BF)
    perm = torch.randperm(n * k, generator=gen).view(n, k)
    w = torch.rand(n, k, generator=gen)
    got = NK.moe_combine(ys, perm, w)
    ref = w[:, 0, None] * ys[perm[:, 0]].float()
    for j in range(1, k):
        ref = ref + w[:, j, None] * ys[perm[:, j]].float()
    assert torch.equal(got, ref.to(BF))
    with pytest.raises(ValueError):
        NK.moe_combine(ys, perm.clamp_max(n * k - 1) + 1, w)


@pytest.mark.parametrize("act_kind", [cpu_kernels.ACT_SITU, cpu_kernels.ACT_SILU])
def test_glu_rows_on_strided_halves(act_kind):
    gen = torch.Generator().manual_seed(7)
    h = (torch.randn(50, 2 * 2100, generator=gen) * 6).to(BF)
    g, u = h[:, :2100], h[:, 2100:]
    lb = 25.0 if act_kind == cpu_kernels.ACT_SITU else None
    got = NK.glu_rows(g, u, act_kind, 4.0, lb)
    ref = situ_and_mul(g, u, 4.0, 25.0) if lb else torch.nn.functional.silu(g) * u
    diff = (got.float() - ref.float()).abs()
    ulp = ref.float().abs().clamp_min(1e-30) * 2.0**-7
    assert bool((diff <= ulp).all())
    assert (got == ref).float().mean() > 0.99
