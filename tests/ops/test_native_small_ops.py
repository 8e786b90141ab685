"""Native elementwise kernels (csrc/small_ops.c) against the PyTorch ops they replace: RMSNorm,
the Block AttnRes mix, K3's KDA decay and the KDA output norm, on sizes that take the vector
body, the scalar tail (widths not a multiple of 16) and the OpenMP split.

Tolerances: bf16 results may differ from torch's by one bf16 ulp (fp32 summation order, and the
kernels' own exp polynomial, ~2 fp32 ulp); fp32 results agree to ~1e-6 relative. Skipped only
where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.ops import kda as K
from deltaserve.ops.attn_res import attn_res_mix
from deltaserve.ops.norms import gated_rms_norm, rms_norm

NK = cpu_kernels.native()
pytestmark = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable (no C compiler)")


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one bf16 ulp, plus fp32 rounding of the largest value (a mix can cancel to ~0)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-20 * float(want.abs().max()))


@pytest.mark.parametrize("n,d", [(1, 1024), (3, 40), (300, 136)])
def test_rms_norm(n, d):
    gen = torch.Generator().manual_seed(d)
    wide = (3 * torch.randn(n, 2 * d, generator=gen)).bfloat16()
    x = wide[:, :d]  # strided rows
    w = torch.randn(d, generator=gen)
    _bf16_close(NK.rms_norm(x, w, 1e-5), rms_norm(x, w.bfloat16(), 1e-5))


@pytest.mark.parametrize("n,d,s", [(1, 1024, 1), (2, 48, 3), (257, 1040, 5)])
def test_attn_res_mix(n, d, s):
    gen = torch.Generator().manual_seed(s)
    xs = [(torch.rand(()) * 4 + 0.1) * torch.randn(n, d, generator=gen) for _ in range(s)]
    xs = [x.bfloat16() for x in xs]
    proj, norm = 0.2 * torch.randn(d, generator=gen), torch.rand(d, generator=gen) + 0.5
    q = (norm * proj).float()
    got = NK.attn_res_mix(xs, q, 1e-5)
    want = attn_res_mix(xs[-1], xs[:-1], proj, norm)
    _bf16_close(got, want)
    w = torch.randn(d, generator=gen)  # the fused norm after the mix: the same bits as the two calls
    assert torch.equal(NK.attn_res_mix(xs, q, 1e-5, w, 1e-6), NK.rms_norm(got, w, 1e-6))
    if s > 1:  # the mix engaged: the result is not just the current block
        assert not torch.equal(got, xs[-1])


@pytest.mark.parametrize("n,h,dk", [(1, 2, 16), (70, 3, 40), (600, 4, 64)])
def test_kda_gate_sigmoid(n, h, dk):
    gen = torch.Generator().manual_seed(n)
    wide = (4 * torch.randn(n, h * dk + 8, generator=gen)).bfloat16()
    f = wide[:, : h * dk].view(n, h, dk)  # strided token rows
    a_log, dt = torch.randn(h, generator=gen), torch.randn(h * dk, generator=gen)
    got = NK.kda_gate_sigmoid(f, a_log, dt, -5.0)
    want = K.kda_gate_sigmoid(f, a_log, dt, -5.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert float(got.max()) < 0 and float(got.min()) >= -5.0  # lb * sigmoid: within (lb, 0)
    with pytest.raises(ValueError):
        NK.kda_gate_sigmoid(f.float(), a_log, dt, -5.0)


@pytest.mark.parametrize("n,h,dk", [(1, 2, 16), (70, 3, 40), (600, 4, 64)])
def test_gated_rms_norm(n, h, dk):
    gen = torch.Generator().manual_seed(n + 1)
    o = torch.randn(n, h, dk, generator=gen) * torch.rand(n, h, 1, generator=gen)
    wide = (3 * torch.randn(n, h * dk + 16, generator=gen)).bfloat16()
    gate = wide[:, : h * dk].view(n, h, dk)
    w = torch.randn(dk, generator=gen)
    _bf16_close(NK.gated_rms_norm(o, w, gate, 1e-5), gated_rms_norm(o, w, gate, 1e-5, torch.bfloat16))
    with pytest.raises(ValueError):
        NK.gated_rms_norm(o, w, gate.float(), 1e-5)
