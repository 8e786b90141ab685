"""Fast KDA ops vs the float64 token-loop oracle: varlen chunked prefill with initial states and
interior exports, the decode step, and the varlen conv with tails."""

import torch

from deltaserve.ops import kda
from deltaserve.ops.reference import kda as ref


def _inputs(lens, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = ref.naive_l2_norm(torch.randn(n, h, d, generator=g, dtype=torch.float64))
    k = ref.naive_l2_norm(torch.randn(n, h, d, generator=g, dtype=torch.float64))
    v = torch.randn(n, h, d, generator=g, dtype=torch.float64)
    gate = -torch.rand(n, h, d, generator=g, dtype=torch.float64) * 5
    beta = torch.rand(n, h, generator=g, dtype=torch.float64)
    s0 = torch.randn(len(lens), h, d, d, generator=g, dtype=torch.float64)
    return q, k, v, gate, beta, s0


def test_chunked_varlen_with_exports_matches_token_loop():
    lens = [1, 5, 63, 64, 65, 130]
    q, k, v, g, beta, s0 = _inputs(lens)
    cu = torch.tensor([0, *lens]).cumsum(0)
    offs = [[1], [2, 5], [17, 63], [64], [1, 64, 65], [17, 100, 130]]
    scale = 16**-0.5
    f32 = [t.float() for t in (q, k, v, g, beta)]
    o, final, exported = kda.kda_chunked(*f32, cu, scale, initial_state=s0.float(), export_offsets=offs)
    e = 0
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(lo, hi)
        o_ref, s_ref = ref.naive_recurrent_kda(q[sl], k[sl], v[sl], g[sl], beta[sl], scale, s0[b])
        torch.testing.assert_close(o[sl].double(), o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[b].double(), s_ref, rtol=1e-5, atol=1e-5)
        for off in offs[b]:
            sp = slice(lo, lo + off)
            _, s_off = ref.naive_recurrent_kda(q[sp], k[sp], v[sp], g[sp], beta[sp], scale, s0[b])
            torch.testing.assert_close(exported[e].double(), s_off, rtol=1e-5, atol=1e-5)
            e += 1
    assert e == exported.shape[0]


def test_recurrent_step_matches_oracle():
    q, k, v, g, beta, s0 = _inputs([1, 1, 1], h=3, d=128, seed=1)
    state = s0.float().clone()
    o = kda.kda_recurrent_step(q.float(), k.float(), v.float(), g.float(), beta.float(), state, 0.1)
    for b in range(3):
        o_ref, s_ref = ref.naive_recurrent_kda(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], 0.1, s0[b]
        )
        torch.testing.assert_close(o[b].double(), o_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[b].double(), s_ref, rtol=1e-5, atol=1e-5)


def test_varlen_conv_with_tails_matches_oracle():
    g = torch.Generator().manual_seed(2)
    lens, c, w = [1, 2, 9], 6, 4
    x = torch.randn(sum(lens), c, generator=g, dtype=torch.float64)
    weight = torch.randn(c, w, generator=g, dtype=torch.float64)
    tails = torch.randn(len(lens), w - 1, c, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *lens]).cumsum(0)
    y, new_tails = kda.causal_conv1d(x.float(), weight.float(), cu, tails.float())
    for b, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_ref, t_ref = ref.naive_causal_conv1d(x[lo:hi], weight, tails[b])
        torch.testing.assert_close(y[lo:hi].double(), y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_tails[b].double(), t_ref, rtol=1e-6, atol=1e-6)
