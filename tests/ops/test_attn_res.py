"""Block AttnRes mix vs its oracle and closed forms (spec/model.md §5)."""

import math

import pytest
import torch

from deltaserve.ops.attn_res import attn_res_mix
from deltaserve.ops.reference.dense import naive_attn_res_mix

RTOL = 1e-6  # fp32 op vs float64 oracle: elementwise, plus RTOL * max|ref| absolute


def _close(out, ref):
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=RTOL * float(ref.abs().max()))


@pytest.mark.parametrize("n_bank", [0, 1, 3, 8])
def test_mix_fp32_vs_oracle(n_bank):
    torch.manual_seed(n_bank)
    d = 64
    scales = torch.rand(n_bank + 1) * 5 + 0.1  # very different source norms
    srcs = [torch.randn(9, d) * s for s in scales]
    bank, cur = srcs[:-1], srcs[-1]
    proj, norm = torch.randn(1, d) * 0.3, torch.rand(d) + 0.5
    out = attn_res_mix(cur, bank, proj.flatten(), norm)
    assert out.dtype == torch.float32 and out.shape == cur.shape
    _close(out, naive_attn_res_mix(cur.double(), [b.double() for b in bank], proj.double(), norm.double()))


def test_empty_bank_returns_cur():
    cur = torch.randn(4, 32).bfloat16()
    assert torch.equal(attn_res_mix(cur, [], torch.randn(32), torch.randn(32)), cur)


def _two_sources(d=64):
    x0 = torch.full((1, d), 3.0)  # rms 3: normalised to ~ +1
    x1 = torch.full((1, d), -0.5)  # rms 0.5: normalised to ~ -1
    return x0, x1


def _closed_form(x0, x1, q, eps=1e-5, score_scale=1.0, mix_normalised=False):
    d = x0.shape[1]
    h0 = x0 / math.sqrt(float((x0**2).mean()) + eps)
    h1 = x1 / math.sqrt(float((x1**2).mean()) + eps)
    e0, e1 = float((h0 * q).sum()) * score_scale, float((h1 * q).sum()) * score_scale
    a0 = 1 / (1 + math.exp(e1 - e0))
    v0, v1 = (h0, h1) if mix_normalised else (x0, x1)
    return a0 * v0 + (1 - a0) * v1, d


def test_mix_raw_values_no_sqrt_d_scale():
    """Catches mixing the normalised candidates and a 1/sqrt(D) score scale."""
    x0, x1 = _two_sources()
    proj, norm = torch.full((64,), 0.05, dtype=torch.float64), torch.ones(64)
    out = attn_res_mix(x1.double(), [x0.double()], proj, norm)
    right, d = _closed_form(x0.double(), x1.double(), 0.05)
    wrong_scale, _ = _closed_form(x0.double(), x1.double(), 0.05, score_scale=d**-0.5)
    wrong_vals, _ = _closed_form(x0.double(), x1.double(), 0.05, mix_normalised=True)
    torch.testing.assert_close(out, right, rtol=1e-12, atol=1e-12)
    assert (out - wrong_scale).abs().min() > 0.5
    assert (out - wrong_vals).abs().min() > 0.5


def test_norm_weight_only_folded_into_score():
    """(n * c, p / c) gives the same score vector, so the same output; applying n as a real
    RMSNorm weight on the mixed value would scale the output by c."""
    torch.manual_seed(7)
    d = 48
    bank = [torch.randn(6, d) * 2 for _ in range(3)]
    cur = torch.randn(6, d)
    proj, norm = torch.randn(d) * 0.2, torch.rand(d) + 0.5
    a = attn_res_mix(cur, bank, proj, norm)
    b = attn_res_mix(cur, bank, proj / 4, norm * 4)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    same = [cur.clone() for _ in range(3)]
    torch.testing.assert_close(attn_res_mix(cur, same, proj, norm * 4), cur, rtol=1e-6, atol=1e-6)


def test_eps_and_bf16_output():
    torch.manual_seed(8)
    d = 32
    tiny = [torch.randn(3, d) * 1e-3 for _ in range(2)]  # mean(x^2) ~ 1e-6 ~ eps
    proj, norm = torch.randn(d) * 3, torch.ones(d)
    out = attn_res_mix(tiny[1], tiny[:1], proj, norm).double()
    ref = naive_attn_res_mix(tiny[1].double(), [tiny[0].double()], proj.double(), norm.double())
    wrong = naive_attn_res_mix(tiny[1].double(), [tiny[0].double()], proj.double(), norm.double(), eps=1e-6)
    _close(out, ref)
    assert (out - wrong).abs().max() > 1e-5
    cur = torch.randn(5, d).bfloat16()
    bank = [torch.randn(5, d).bfloat16() * 4 for _ in range(4)]
    b = attn_res_mix(cur, bank, proj.bfloat16(), norm.bfloat16())
    assert b.dtype == torch.bfloat16
    ref = naive_attn_res_mix(
        cur.double(), [x.double() for x in bank], proj.bfloat16().double(), norm.bfloat16().double()
    )
    torch.testing.assert_close(b.double(), ref, rtol=2**-8, atol=1e-6)  # one bf16 rounding
