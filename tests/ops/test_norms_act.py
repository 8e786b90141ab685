"""RMSNorm, gated RMSNorm, SiTU and SwiGLU vs their oracles (spec/model.md §3, §10)."""

import math

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.activations import silu_and_mul, situ_and_mul
from deltaserve.ops.norms import gated_rms_norm, rms_norm
from deltaserve.ops.reference.dense import naive_gated_rms_norm, naive_rms_norm, naive_silu_and_mul, naive_situ_and_mul

RTOL = 1e-6  # fp32 op vs float64 oracle


def _close(fast, ref, rtol=RTOL, atol=1e-7):
    torch.testing.assert_close(fast.double(), ref.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_fp32_vs_oracle(eps):
    torch.manual_seed(0)
    x = torch.randn(37, 96) * 3
    w = torch.randn(96)
    out = rms_norm(x, w, eps)
    assert out.dtype == torch.float32 and out.shape == x.shape
    _close(out, naive_rms_norm(x.double(), w.double(), eps))


def test_rms_norm_eps_is_honoured():
    """Small-norm input (mean(x^2) ~ 1e-6): eps 1e-5 and 1e-6 differ by far more than RTOL."""
    torch.manual_seed(1)
    x = torch.randn(16, 64) * 1e-3
    w = torch.ones(64)
    for eps, other in [(1e-5, 1e-6), (1e-6, 1e-5)]:
        out = rms_norm(x, w, eps).double()
        _close(out, naive_rms_norm(x.double(), w.double(), eps))
        wrong = naive_rms_norm(x.double(), w.double(), other)
        assert ((out - wrong).abs() / wrong.abs()).max() > 0.1


def test_rms_norm_bf16_casts_before_weight():
    """bf16(w * bf16(x_hat)) (upstream) vs bf16(w * x_hat): the double rounding differs often."""
    torch.manual_seed(2)
    x = (torch.randn(64, 256) * 2).bfloat16()
    w = (torch.rand(256) * 2 + 0.5).bfloat16()
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    x64 = x.double()
    x_hat = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5)
    right = (w.double() * x_hat.bfloat16().double()).bfloat16()
    wrong = (w.double() * x_hat).bfloat16()
    n = out.numel()
    assert (out != right).sum() <= n // 1000  # only fp32-vs-fp64 rounding ties
    assert (wrong != right).sum() > n // 20  # the wrong order is clearly detectable
    assert (out != wrong).sum() > n // 20
    assert (out != naive_rms_norm(x, w, 1e-5)).sum() <= n // 1000


def test_gated_rms_norm_vs_oracle():
    torch.manual_seed(3)
    x = torch.randn(5, 3, 128)
    gate = torch.randn(5, 3, 128) * 4
    w = torch.randn(128)
    out = gated_rms_norm(x, w, gate, 1e-5, torch.float32)
    _close(out, naive_gated_rms_norm(x.double(), w.double(), gate.double(), 1e-5, torch.float64))
    b = gated_rms_norm(x.bfloat16(), w, gate.bfloat16(), 1e-5, torch.bfloat16)
    assert b.dtype == torch.bfloat16
    ref = naive_gated_rms_norm(x.bfloat16().double(), w.double(), gate.bfloat16().double(), 1e-5, torch.float64)
    _close(b, ref, rtol=2**-8, atol=1e-6)


def _situ_inputs():
    torch.manual_seed(4)
    gate = torch.cat([torch.randn(4000) * 6, torch.linspace(-60, 60, 241)])
    up = torch.cat([torch.randn(4000) * 30, torch.linspace(-200, 200, 241)])
    return gate, up


def test_situ_fp32_vs_oracle():
    gate, up = _situ_inputs()
    out = situ_and_mul(gate, up, 4.0, 25.0)
    assert out.dtype == torch.float32
    _close(out, naive_situ_and_mul(gate.double(), up.double(), 4.0, 25.0), atol=1e-6)


def test_situ_known_values():
    """Hand-computed points: the left factor saturates at beta, the right one at beta_lin."""
    g = torch.tensor([0.0, 2.0, 20.0, -3.0, 5.0])
    u = torch.tensor([7.0, 3.0, 1.0, -50.0, 100.0])

    def sig(v):
        return 1 / (1 + math.exp(-v))

    expect = [
        0.0,
        4 * math.tanh(0.5) * sig(2) * 25 * math.tanh(3 / 25),
        4 * math.tanh(5) * sig(20) * 25 * math.tanh(1 / 25),
        4 * math.tanh(-0.75) * sig(-3) * 25 * math.tanh(-2),
        4 * math.tanh(1.25) * sig(5) * 25 * math.tanh(4),
    ]
    _close(situ_and_mul(g, u, 4.0, 25.0), torch.tensor(expect, dtype=torch.float64), atol=1e-6)


def test_situ_right_cap_and_not_silu():
    g = torch.tensor([20.0, 5.0, 1.0])
    u = torch.tensor([1.0, 100.0, 400.0])
    out = situ_and_mul(g, u, 4.0, 25.0).double()
    left = 4 * torch.tanh(g.double() / 4) * torch.sigmoid(g.double())
    uncapped = left * u.double()
    silu = F.silu(g.double()) * 25 * torch.tanh(u.double() / 25)
    assert (out.abs() <= left.abs() * 25 + 1e-5).all()  # bounded by the cap
    assert ((out - uncapped).abs()[1:] > 10).all()  # missing right cap
    assert (out - silu).abs()[0] > 10  # SiLU left factor
    assert out[0] == pytest.approx(4 * math.tanh(5) * (1 / (1 + math.exp(-20))) * 25 * math.tanh(0.04), rel=1e-6)


def test_situ_linear_beta_none_and_bf16():
    gate, up = _situ_inputs()
    out = situ_and_mul(gate, up, 4.0, None)
    _close(out, 4 * torch.tanh(gate.double() / 4) * torch.sigmoid(gate.double()) * up.double(), atol=1e-5)
    gb, ub = gate.bfloat16(), up.bfloat16()
    b = situ_and_mul(gb, ub, 4.0, 25.0)
    assert b.dtype == torch.bfloat16
    ref = naive_situ_and_mul(gb.double(), ub.double(), 4.0, 25.0)
    _close(b, ref, rtol=2**-8, atol=1e-6)  # one bf16 rounding


def test_silu_and_mul():
    torch.manual_seed(5)
    g, u = torch.randn(300) * 5, torch.randn(300)
    _close(silu_and_mul(g, u), naive_silu_and_mul(g.double(), u.double()), atol=1e-6)
    assert silu_and_mul(g.bfloat16(), u.bfloat16()).dtype == torch.bfloat16
