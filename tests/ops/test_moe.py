"""Router and grouped experts vs per-token oracles (spec/model.md §8-9).

Tolerances: fp32 op vs float64 oracle within 1e-5 relative (+ 1e-5 * max|ref| absolute);
the bf16 rounding-order test is exact.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.activations import silu_and_mul, situ_and_mul
from deltaserve.ops.moe import grouped_experts, route
from deltaserve.ops.norms import rms_norm
from deltaserve.ops.reference.dense import (
    naive_grouped_experts,
    naive_latent_moe,
    naive_moe,
    naive_route,
    naive_silu_and_mul,
    naive_situ_and_mul,
)

TOL = 1e-5
situ = functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0)
naive_situ = functools.partial(naive_situ_and_mul, beta=4.0, linear_beta=25.0)


def _close(out, ref, tol=TOL):
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol * float(ref.abs().max()))


def _by_id(w, ids):
    """Sort each token's (weight, id) pairs by id so that slot order does not matter."""
    order = ids.argsort(-1)
    return w.gather(1, order), ids.gather(1, order)


def _router_case(n=24, e=64, d=32, seed=0):
    torch.manual_seed(seed)
    return torch.randn(n, d), torch.randn(e, d) * 0.5, torch.randn(e) * 0.3


@pytest.mark.parametrize("groups,topk_group,scale", [(1, 1, 1.0), (1, 1, 2.446), (8, 3, 1.0)])
def test_route_vs_oracle(groups, topk_group, scale):
    x, gw, bias = _router_case()
    for flag in (False, True):
        w, ids = route(x, gw, bias, 6, groups, topk_group, True, scale, flag)
        assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (24, 6)
        rw, rids = naive_route(x.double(), gw.double(), bias.double(), 6, groups, topk_group, True, scale, flag)
        (w, ids), (rw, rids) = _by_id(w, ids), _by_id(rw, rids)
        assert torch.equal(ids, rids)
        _close(w, rw)
        torch.testing.assert_close(w.sum(-1).double(), torch.full((24,), scale, dtype=torch.float64))


def test_route_weights_unbiased_by_default_biased_with_flag():
    """K3 (and transformers/vLLM Kimi-Linear): weights are the UNBIASED scores at experts chosen
    by the biased ones; bias_in_weights=True gives Moonshot's remote-code (biased) weights."""
    x, gw, bias = _router_case(seed=1)
    s = torch.sigmoid(x.double() @ gw.double().T)
    w, ids = route(x, gw, bias, 8, routed_scaling_factor=2.446)
    wb, idb = route(x, gw, bias, 8, routed_scaling_factor=2.446, bias_in_weights=True)
    assert torch.equal(ids, idb)  # selection is the same
    assert torch.equal(ids.sort(-1).values, (s + bias.double()).topk(8).indices.sort(-1).values)
    assert not torch.equal(ids.sort(-1).values, s.topk(8).indices.sort(-1).values)  # bias matters
    unb = s.gather(1, ids)
    biased = (s + bias.double()).gather(1, ids)
    _close(w, 2.446 * unb / unb.sum(-1, keepdim=True))
    _close(wb, 2.446 * biased / biased.sum(-1, keepdim=True))
    assert (w.double() - wb.double()).abs().max() > 1e-2


def test_route_renormalisation_and_epsilon():
    x, gw, _ = _router_case(seed=2)
    s = torch.sigmoid(x.double() @ gw.double().T)
    w, ids = route(x, gw, None, 4, routed_scaling_factor=2.446)
    _close(w.sum(-1), torch.full((24,), 2.446))  # renormalised, then scaled
    raw, _ = route(x, gw, None, 4, renormalize=False, routed_scaling_factor=2.446)
    _close(raw, 2.446 * s.gather(1, ids))
    # All-tiny scores (sigmoid(-60) ~ 1e-26): the 1e-20 dominates the renormaliser.
    tiny_x, tiny_w = torch.ones(3, 16), torch.full((8, 16), -60.0 / 16) + torch.randn(8, 16) * 1e-3
    w, ids = route(tiny_x, tiny_w, None, 2)
    rw, rids = naive_route(tiny_x.double(), tiny_w.double(), None, 2)
    _close(w, rw)
    assert (w.sum(-1) < 1e-4).all() and (w > 0).all()
    # Exactly-zero scores (sigmoid(-1000) == 0 in fp32): zero weights, no NaN.
    w, _ = route(tiny_x, tiny_w * 1000 / 60, None, 2)
    assert torch.equal(w, torch.zeros(3, 2))


def _group_bias():
    """Zero gate weights give s = 0.5 everywhere; the bias shapes the 3 groups of 4:
    A (0.9, .1, .08, .06): top-2 sum 1.00, max .90; B (.55, .55, 0, 0): top-2 sum 1.10;
    C (.42, .41, .40, .39): top-2 sum 0.83, full sum 1.62."""
    picks = torch.tensor([0.9, 0.1, 0.08, 0.06, 0.55, 0.55, 0, 0, 0.42, 0.41, 0.40, 0.39])
    return torch.randn(2, 8), torch.zeros(12, 8), picks - 0.5


def test_grouped_topk_uses_top2_group_scores():
    x, gw, bias = _group_bias()
    _, ids = route(x, gw, bias, 2, num_expert_group=3, topk_group=1)
    assert ids.sort(-1).values.tolist() == [[4, 5]] * 2  # max -> A, full sum -> C
    _, ids = route(x, gw, bias, 4, num_expert_group=3, topk_group=2)
    assert ids.sort(-1).values.tolist() == [[0, 1, 4, 5]] * 2  # ungrouped would pick 8
    _, ids = route(x, gw, bias, 4)
    assert ids.sort(-1).values.tolist() == [[0, 4, 5, 8]] * 2
    w, ids = route(x, gw, bias, 2, num_expert_group=3, topk_group=1, routed_scaling_factor=2.0)
    assert torch.equal(w, torch.ones(2, 2))  # unbiased 0.5 each
    w, ids = route(x, gw, bias, 4, num_expert_group=3, topk_group=2, bias_in_weights=True)
    rw, rids = naive_route(x, gw, bias, 4, 3, 2, bias_in_weights=True)
    (w, ids), (rw, rids) = _by_id(w, ids), _by_id(rw, rids)
    assert torch.equal(ids, rids)
    _close(w, rw)
    _close(w[0], torch.tensor([0.9, 0.1, 0.55, 0.55]) / 2.1)
    # Negative biased scores in the kept group: masked groups must lose (-inf, not 0).
    neg = torch.tensor([-0.1, -0.2, -1.5, -1.6, -0.9, -0.95]) - 0.5
    _, ids = route(x, torch.zeros(6, 8), neg, 2, num_expert_group=3, topk_group=1)
    assert ids.sort(-1).values.tolist() == [[0, 1]] * 2


def _experts(e, d, i, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return (
        torch.randn(e, i, d, dtype=dtype) * d**-0.5,
        torch.randn(e, i, d, dtype=dtype) * d**-0.5,
        torch.randn(e, d, i, dtype=dtype) * i**-0.5,
    )


@pytest.mark.parametrize("act,naive_act", [(situ, naive_situ), (silu_and_mul, naive_silu_and_mul)])
def test_grouped_experts_fp32_vs_oracle(act, naive_act):
    w1, w3, w2 = _experts(64, 32, 24)
    x = torch.randn(40, 32) * 3
    w, ids = route(x, torch.randn(64, 32), torch.randn(64) * 0.1, 4)  # ~half the experts idle
    out = grouped_experts(x, ids, w, w1, w3, w2, act)
    assert out.shape == x.shape and out.dtype == torch.float32
    ref = naive_grouped_experts(x.double(), ids, w.double(), w1.double(), w3.double(), w2.double(), naive_act)
    _close(out, ref)
    assert grouped_experts(x[:0], ids[:0], w[:0], w1, w3, w2, act).shape == (0, 32)


def test_grouped_experts_bf16_rounding_order_exact():
    """Integer activations and weights make every GEMM exact, so the only roundings are the
    documented ones: bf16(expert out), fp32 weight multiply and slot-ordered fp32 sum, bf16(sum).
    The result must equal the oracle bit for bit and differ from the other orders."""
    torch.manual_seed(9)
    e, d, i, n, k = 16, 16, 32, 48, 4

    def ints(lim, *s):
        return torch.randint(-lim, lim + 1, s).bfloat16()

    w1, w3, w2, x = ints(2, e, i, d), ints(2, e, i, d), ints(3, e, d, i), ints(3, n, d)
    w, ids = route(torch.randn(n, 8), torch.randn(e, 8), None, k)

    def mul(g, u):
        return g * u

    out = grouped_experts(x, ids, w, w1, w3, w2, mul)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, naive_grouped_experts(x, ids, w, w1, w3, w2, mul))
    y32 = torch.stack(
        [
            torch.stack(
                [
                    (
                        mul(x[t] @ w1[int(ids[t, j])].T, x[t] @ w3[int(ids[t, j])].T).float()
                        @ w2[int(ids[t, j])].float().T
                    )
                    for j in range(k)
                ]
            )
            for t in range(n)
        ]
    )  # [n, k, d] fp32, exact
    unrounded = (w[..., None] * y32).sum(1).bfloat16()  # no bf16(expert out)
    bf16_sum = y32.bfloat16()
    acc = torch.zeros(n, d).bfloat16()
    for j in range(k):
        acc = acc + (w[:, j, None].bfloat16() * bf16_sum[:, j])  # bf16 weights and sum
    assert not torch.equal(out, unrounded)
    assert not torch.equal(out, acc)


def test_grouped_experts_bf16_situ_close():
    w1, w3, w2 = _experts(32, 64, 48, torch.bfloat16, seed=4)
    x = torch.randn(30, 64).bfloat16()
    w, ids = route(x, torch.randn(32, 64), None, 8)
    out = grouped_experts(x, ids, w, w1, w3, w2, situ)
    ref = naive_grouped_experts(x, ids, w, w1, w3, w2, situ)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref.double(), rtol=2**-7, atol=1e-2)


def test_fast_ops_compose_to_moe_oracles():
    """The model-layer MoE recipes from fast ops (fp32) equal the float64 oracles: K3 latent MoE
    (router on x, SiTU experts on z, norm after the sum, up-proj, shared on x) and Kimi-Linear
    (SwiGLU on x, x2.446, shared expert)."""
    torch.manual_seed(11)
    d, lat, i, e, k, n = 48, 24, 16, 32, 4, 20

    def g(*s):
        return torch.randn(*s, dtype=torch.float64) * s[-1] ** -0.5

    x = torch.randn(n, d, dtype=torch.float64)
    gw, bias = g(e, d), torch.randn(e, dtype=torch.float64) * 0.1
    down, up, norm_w = g(lat, d), g(d, lat), torch.rand(lat, dtype=torch.float64) + 0.5
    shared = (g(2 * i, d), g(2 * i, d), g(d, 2 * i))

    def f(t):
        return t.float()

    xf = f(x)
    w, ids = route(xf, f(gw), f(bias), k)
    ex = _experts(e, lat, i, torch.float64, seed=12)
    r = grouped_experts(F.linear(xf, f(down)), ids, w, *map(f, ex), situ)
    r = F.linear(rms_norm(r, f(norm_w), 1e-5), f(up))
    r = r + F.linear(situ(F.linear(xf, f(shared[0])), F.linear(xf, f(shared[1]))), f(shared[2]))
    _close(r, naive_latent_moe(x, gw, bias, down, up, norm_w, *ex, k, shared))
    ex = _experts(e, d, i, torch.float64, seed=13)
    w, ids = route(xf, f(gw), f(bias), k, routed_scaling_factor=2.446)
    r = grouped_experts(xf, ids, w, *map(f, ex), silu_and_mul)
    r = r + F.linear(silu_and_mul(F.linear(xf, f(shared[0])), F.linear(xf, f(shared[1]))), f(shared[2]))
    _close(r, naive_moe(x, gw, bias, *ex, k, shared, routed_scaling_factor=2.446))
