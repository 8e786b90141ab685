"""RMSNorm, gated norm, SiTU/SwiGLU and the AttnRes mix vs float64 formulas written out here,
with checks that the documented pitfalls (eps, cast order, caps, normalised-value mixing) show."""

import torch

from deltaserve.ops.activations import silu_and_mul, situ_and_mul
from deltaserve.ops.attn_res import attn_res_mix
from deltaserve.ops.norms import gated_rms_norm, rms_norm

G = torch.Generator().manual_seed(0)


def test_rms_norm_eps_and_cast_order():
    x = torch.randn(4, 64, generator=G) * 3e-3  # small norm: eps matters
    w = torch.randn(64, generator=G)
    xd = x.double()
    ref = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), ref, rtol=1e-5, atol=1e-6)
    assert (rms_norm(x, w, 1e-5) - rms_norm(x, w, 1e-6)).abs().max() > 1e-3
    xb, wb = torch.randn(8, 64, generator=G).bfloat16(), torch.randn(64, generator=G).bfloat16()
    xf = xb.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    cast_first = wb * normed.bfloat16()
    assert torch.equal(rms_norm(xb, wb, 1e-5), cast_first)
    assert not torch.equal(cast_first, (wb.float() * normed).bfloat16())


def test_gated_rms_norm():
    x, gate = torch.randn(3, 2, 32, generator=G), torch.randn(3, 2, 32, generator=G)
    w = torch.randn(32, generator=G)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double() * torch.sigmoid(gate.double())
    got = gated_rms_norm(x, w, gate, 1e-5, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(gated_rms_norm(x, w, gate, 1e-5, torch.float32).double(), ref, rtol=1e-5, atol=1e-6)


def test_situ_caps_both_branches():
    gate = torch.linspace(-40, 40, 101)
    up = torch.linspace(-200, 200, 101)
    out = situ_and_mul(gate, up, 4.0, 25.0)
    g, u = gate.double(), up.double()
    ref = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert out.abs().max() <= 100 + 1e-3  # both caps bound the product
    assert (out - silu_and_mul(gate, up)).abs().max() > 1.0  # not SiLU
    torch.testing.assert_close(
        situ_and_mul(gate, up, 4.0, None).double(), 4 * torch.tanh(g / 4) * torch.sigmoid(g) * u, rtol=1e-5, atol=1e-5
    )


def test_attn_res_mix_formula_and_pitfalls():
    n, d = 5, 48
    bank = [torch.randn(n, d, generator=G) * s for s in (1.0, 4.0, 0.5)]
    cur = torch.randn(n, d, generator=G) * 2
    proj, norm = torch.randn(d, generator=G), torch.rand(d, generator=G) + 0.5
    x = torch.stack([*bank, cur]).double()
    xn = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    a = torch.softmax(xn @ (norm.double() * proj.double()), 0)
    ref = (a[..., None] * x).sum(0)
    got = attn_res_mix(cur, bank, proj, norm)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert (ref - (a[..., None] * xn).sum(0)).abs().max() > 1e-2  # raw values, not normalised
    a_scaled = torch.softmax(xn @ (norm.double() * proj.double()) / d**0.5, 0)
    assert (ref - (a_scaled[..., None] * x).sum(0)).abs().max() > 1e-2  # no 1/sqrt(D)
    assert torch.equal(attn_res_mix(cur, [], proj, norm), cur)
