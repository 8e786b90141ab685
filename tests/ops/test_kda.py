"""Fast KDA ops (deltaserve.ops.kda) against the float64 oracles in ops.reference.kda.

Tolerances: fast ops run in fp32; oracles run in float64 on the same (fp32-representable)
inputs. Recurrence outputs and states are O(1), and the fp32 chunked path lands within ~1e-6 of
the oracle, so STATE_TOL (5e-6 rtol and atol) leaves a >5x margin and would still catch a wrong
decay, order or offset. Elementwise ops use ELEM_TOL. Copies (conv tails) must match exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.ops import kda as K
from deltaserve.ops.reference import kda as R

F64 = torch.float64
STATE_TOL = dict(rtol=5e-6, atol=5e-6)
ELEM_TOL = dict(rtol=1e-6, atol=1e-6)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.long).cumsum(0).tolist())


def _inputs(lens, h, dk, dv, g_lo=-1.0, g_hi=0.0, seed=0):
    """fp32-representable float64 inputs (q, k L2-normalised), plus a nonzero initial state."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).float().double()

    q = R.naive_l2_norm(rnd(n, h, dk)).float().double()
    k = R.naive_l2_norm(rnd(n, h, dk)).float().double()
    v = rnd(n, h, dv)
    g = (g_lo + (g_hi - g_lo) * torch.rand(n, h, dk, generator=gen, dtype=F64)).float().double()
    beta = torch.rand(n, h, generator=gen, dtype=F64).float().double()
    s0 = 0.5 * rnd(len(lens), h, dk, dv)
    return q, k, v, g, beta, s0


def _f32(*xs):
    return [x.float() for x in xs]


def _oracle(lens, q, k, v, g, beta, s0, scale):
    cu = _cu(lens)
    outs, states = [], []
    for b in range(len(lens)):
        a, z = int(cu[b]), int(cu[b + 1])
        o, s = R.naive_recurrent_kda(q[a:z], k[a:z], v[a:z], g[a:z], beta[a:z], scale, s0[b])
        outs.append(o)
        states.append(s)
    return torch.cat(outs), torch.stack(states)


def _close(actual, expected, tol):
    torch.testing.assert_close(actual.double(), expected, **tol)


# ---------------------------------------------------------------------------------- gates, norm


def test_gate_sigmoid_matches_hand_formula():
    h, dk = 3, 16
    gen = torch.Generator().manual_seed(1)
    f = 2 * torch.randn(5, h, dk, generator=gen)
    a_log = torch.tensor([-0.5, 0.0, 0.7])
    dt = torch.randn(h * dk, generator=gen)
    g = K.kda_gate_sigmoid(f, a_log, dt, lower_bound=-5.0)
    assert g.dtype == torch.float32 and g.shape == f.shape
    for t, hh, c in [(0, 0, 0), (4, 2, 15), (2, 1, 7)]:
        x = math.exp(a_log[hh].item()) * (f[t, hh, c].item() + dt[hh * dk + c].item())
        assert g[t, hh, c].item() == pytest.approx(-5.0 / (1 + math.exp(-x)), rel=1e-6)
    _close(g, R.naive_kda_gate_sigmoid(f.double(), a_log.double(), dt.double()), ELEM_TOL)
    zero = K.kda_gate_sigmoid(torch.zeros(1, h, dk), a_log, torch.zeros(h * dk), lower_bound=-3.0)
    assert torch.equal(zero, torch.full_like(zero, -1.5))
    assert bool((g < 0).all() and (g > -5).all())


def test_gate_softplus_matches_hand_formula_and_is_safe():
    h, dk = 2, 16
    gen = torch.Generator().manual_seed(2)
    f = 3 * torch.randn(4, h, dk, generator=gen)
    a_log = torch.tensor([0.3, -1.2])
    dt = torch.randn(h * dk, generator=gen)
    g = K.kda_gate_softplus(f, a_log, dt)
    for t, hh, c in [(0, 0, 0), (3, 1, 15), (1, 1, 3)]:
        x = f[t, hh, c].item() + dt[hh * dk + c].item()
        want = -math.exp(a_log[hh].item()) * math.log1p(math.exp(x))
        assert g[t, hh, c].item() == pytest.approx(want, rel=1e-6)
    _close(g, R.naive_kda_gate_softplus(f.double(), a_log.double(), dt.double()), ELEM_TOL)
    big = torch.tensor([100.0, 30.0, -100.0, 0.0]).repeat(4).view(1, 1, 16)
    gb = K.kda_gate_softplus(big, torch.zeros(1), torch.zeros(16))
    assert bool(torch.isfinite(gb).all())
    want = [-100.0, -30.0, -math.exp(-100.0), -math.log(2.0)]
    torch.testing.assert_close(gb[0, 0, :4], torch.tensor(want), rtol=1e-6, atol=0.0)


def test_l2_norm_eps_inside_sqrt():
    x = torch.zeros(2, 3, 16)
    x[..., 0] = 1e-3  # sum x^2 = 1e-6 = eps
    y = K.l2_norm(x)
    # eps inside the sqrt: 1e-3 / sqrt(2e-6) = 0.70711; outside: ~0.999; eps 1e-5: ~0.3015
    want = torch.full((2, 3), 1.0 / math.sqrt(2.0))
    torch.testing.assert_close(y[..., 0], want, rtol=1e-6, atol=0)
    xr = torch.randn(7, 4, 128, dtype=torch.bfloat16)
    yr = K.l2_norm(xr)
    assert yr.dtype == torch.float32
    _close(yr, R.naive_l2_norm(xr.double()), ELEM_TOL)


# ------------------------------------------------------------------------------------ conv1d


def _conv_oracle(x, w, lens, tail):
    cu = _cu(lens)
    ys, tails = [], []
    for b in range(len(lens)):
        y, t = R.naive_causal_conv1d(x[cu[b] : cu[b + 1]], w, None if tail is None else tail[b])
        ys.append(y)
        tails.append(t)
    return torch.cat(ys), torch.stack(tails)


@pytest.mark.parametrize("with_tail", [True, False])
def test_causal_conv1d_varlen_matches_oracle(with_tail):
    lens, c, w = [1, 2, 0, 3, 5, 17], 24, 4
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(lens), c, generator=gen)
    wt = torch.randn(c, w, generator=gen)
    tail = torch.randn(len(lens), w - 1, c, generator=gen) if with_tail else None
    y, t = K.causal_conv1d(x, wt, _cu(lens), tail)
    tail64 = None if tail is None else tail.double()
    y_ref, t_ref = _conv_oracle(x.double(), wt.double(), lens, tail64)
    assert y.dtype == torch.float32 and t.dtype == x.dtype and t.shape == (len(lens), w - 1, c)
    _close(y, y_ref, ELEM_TOL)
    assert torch.equal(t.double(), t_ref)  # tails are copies of pre-conv inputs
    if with_tail:
        assert torch.equal(t[2], tail[2])  # empty sequence keeps its tail
        assert torch.equal(t[0], torch.cat([tail[0, 1:], x[:1]]))


def test_causal_conv1d_tail_continuity():
    lens, cut, c, w = [20, 9, 2], [7, 1, 1], 8, 4
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(lens), c, generator=gen, dtype=torch.bfloat16)
    wt = torch.randn(c, w, generator=gen)
    tail0 = torch.randn(3, w - 1, c, generator=gen).to(torch.bfloat16)
    cu = _cu(lens)
    y_all, t_all = K.causal_conv1d(x, wt, cu, tail0)
    first = torch.cat([x[cu[b] : cu[b] + cut[b]] for b in range(3)])
    second = torch.cat([x[cu[b] + cut[b] : cu[b + 1]] for b in range(3)])
    y1, t1 = K.causal_conv1d(first, wt, _cu(cut), tail0)
    y2, t2 = K.causal_conv1d(second, wt, _cu([n - c_ for n, c_ in zip(lens, cut)]), t1)
    assert t1.dtype == torch.bfloat16
    c1, c2 = _cu(cut), _cu([n - c_ for n, c_ in zip(lens, cut)])
    joined = torch.cat([torch.cat([y1[c1[b] : c1[b + 1]], y2[c2[b] : c2[b + 1]]]) for b in range(3)])
    torch.testing.assert_close(joined, y_all, rtol=1e-6, atol=1e-6)
    assert torch.equal(t2, t_all)


def test_causal_conv1d_step_matches_oracle_and_prefill():
    b, c, w = 3, 16, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(b, c, generator=gen)
    wt = torch.randn(c, w, generator=gen)
    tail = torch.randn(b, w - 1, c, generator=gen)
    y, t = K.causal_conv1d_step(x, wt, tail)
    y_ref, t_ref = _conv_oracle(x.double(), wt.double(), [1] * b, tail.double())
    _close(y, y_ref, ELEM_TOL)
    assert torch.equal(t.double(), t_ref)
    y_pre, t_pre = K.causal_conv1d(x, wt, _cu([1] * b), tail)
    torch.testing.assert_close(y, y_pre, rtol=1e-6, atol=1e-6)
    assert torch.equal(t, t_pre)


# ------------------------------------------------------------------------------- KDA chunked

LENS = [1, 5, 63, 64, 65, 130, 200]


@pytest.mark.parametrize("h,dk,dv", [(1, 16, 16), (2, 128, 128), (4, 16, 32)])
def test_kda_chunked_varlen_matches_recurrent_oracle(h, dk, dv):
    q, k, v, g, beta, s0 = _inputs(LENS, h, dk, dv, seed=h)
    scale = dk**-0.5
    o, s, ex = K.kda_chunked(*_f32(q, k, v, g, beta), _cu(LENS), scale, s0.float())
    o_ref, s_ref = _oracle(LENS, q, k, v, g, beta, s0, scale)
    assert ex is None and o.dtype == torch.float32 and s.shape == (len(LENS), h, dk, dv)
    _close(o, o_ref, STATE_TOL)
    _close(s, s_ref, STATE_TOL)


def test_kda_chunked_zero_state_empty_sequence_strided_inputs():
    lens, h, d = [0, 70, 0, 3], 2, 16
    q, k, v, g, beta, s0 = _inputs(lens, h, d, d, seed=7)
    q32, k32, v32 = torch.stack(_f32(q, k, v), 1).unbind(1)  # strided views, like the layer's
    o, s, _ = K.kda_chunked(q32, k32, v32, g.float(), beta.float(), _cu(lens), 0.25)
    o_ref, s_ref = _oracle(lens, q, k, v, g, beta, torch.zeros_like(s0), 0.25)
    _close(o, o_ref, STATE_TOL)
    _close(s, s_ref, STATE_TOL)
    _, s1, _ = K.kda_chunked(*_f32(q, k, v, g, beta), _cu(lens), 0.25, s0.float())
    assert torch.equal(s1[0], s0[0].float()) and torch.equal(s1[2], s0[2].float())


@pytest.mark.parametrize("g_lo,g_hi", [(-5.0, -4.9), (-40.0, -20.0), (-1e-3, 0.0)])
def test_kda_chunked_extreme_gates(g_lo, g_hi):
    """g ~ -5 everywhere drives G to -320 in a chunk: exp(-G) would overflow fp32."""
    lens, h, d = [130, 64], 2, 128
    q, k, v, g, beta, s0 = _inputs(lens, h, d, d, g_lo, g_hi, seed=8)
    o, s, _ = K.kda_chunked(*_f32(q, k, v, g, beta), _cu(lens), d**-0.5, s0.float())
    o_ref, s_ref = _oracle(lens, q, k, v, g, beta, s0, d**-0.5)
    assert bool(torch.isfinite(o).all() and torch.isfinite(s).all())
    _close(o, o_ref, STATE_TOL)
    _close(s, s_ref, STATE_TOL)


def test_kda_chunked_mixed_decay_within_chunk():
    """Strong decay for the first half of each chunk, almost none after: exponents near 0 after
    a large cumulative decay must stay accurate."""
    lens, h, d = [128, 100], 1, 16
    q, k, v, g, beta, s0 = _inputs(lens, h, d, d, seed=9)
    pos = torch.cat([torch.arange(n) for n in lens]) % 64
    g = torch.where((pos < 32)[:, None, None], -5.0 + 0.1 * g, 1e-3 * g)
    o, s, _ = K.kda_chunked(*_f32(q, k, v, g, beta), _cu(lens), d**-0.5, s0.float())
    o_ref, s_ref = _oracle(lens, q, k, v, g, beta, s0, d**-0.5)
    _close(o, o_ref, STATE_TOL)
    _close(s, s_ref, STATE_TOL)


def test_kda_chunked_export_offsets():
    lens = [200, 65, 1, 130, 9]
    offsets = [[1, 17, 64, 100, 200], [65], [1], [63, 64, 127, 128, 129], []]
    h, d = 2, 16
    q, k, v, g, beta, s0 = _inputs(lens, h, d, d, seed=10)
    args = (*_f32(q, k, v, g, beta), _cu(lens), d**-0.5, s0.float())
    o, s, ex = K.kda_chunked(*args, export_offsets=offsets)
    o_plain, s_plain, _ = K.kda_chunked(*args)
    assert ex.shape == (sum(map(len, offsets)), h, d, d)
    torch.testing.assert_close(o, o_plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, s_plain, rtol=1e-6, atol=1e-6)
    cu = _cu(lens)
    i = 0
    for b, offs in enumerate(offsets):
        for off in offs:
            a = int(cu[b])
            _, s_pref = R.naive_recurrent_kda(
                q[a : a + off], k[a : a + off], v[a : a + off], g[a : a + off], beta[a : a + off], d**-0.5, s0[b]
            )
            _close(ex[i], s_pref, STATE_TOL)
            i += 1
    _, _, none = K.kda_chunked(*args, export_offsets=[[] for _ in lens])
    assert none.shape == (0, h, d, d)


@pytest.mark.parametrize("bad", [[[0], [], [], [], []], [[201], [], [], [], []], [[1]]])
def test_kda_chunked_rejects_bad_offsets(bad):
    lens = [200, 65, 1, 130, 9]
    q, k, v, g, beta, _ = _inputs(lens, 1, 16, 16)
    with pytest.raises(ValueError):
        K.kda_chunked(*_f32(q, k, v, g, beta), _cu(lens), 0.25, export_offsets=bad)


@pytest.mark.parametrize("chunk", [16, 48, 64])
def test_kda_chunked_chunk_size_invariant(chunk):
    lens, h, d = [150, 33], 2, 16
    q, k, v, g, beta, s0 = _inputs(lens, h, d, d, seed=11)
    o, s, _ = K.kda_chunked(*_f32(q, k, v, g, beta), _cu(lens), 0.25, s0.float(), chunk_size=chunk)
    o_ref, s_ref = _oracle(lens, q, k, v, g, beta, s0, 0.25)
    _close(o, o_ref, STATE_TOL)
    _close(s, s_ref, STATE_TOL)


def test_naive_chunk_oracle_matches_naive_recurrent():
    for t_len, chunk in [(1, 64), (64, 64), (150, 64), (40, 16)]:
        q, k, v, g, beta, s0 = _inputs([t_len], 2, 16, 8, g_lo=-5.0, seed=t_len)
        o_c, s_c = R.naive_chunk_kda(q, k, v, g, beta, 0.3, s0[0], chunk_size=chunk)
        o_r, s_r = R.naive_recurrent_kda(q, k, v, g, beta, 0.3, s0[0])
        torch.testing.assert_close(o_c, o_r, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s_c, s_r, rtol=1e-10, atol=1e-10)


# -------------------------------------------------------------------------------- decode step


def test_recurrent_step_matches_oracle_in_place():
    b, h, dk, dv = 3, 4, 128, 128
    q, k, v, g, beta, s0 = _inputs([1] * b, h, dk, dv, seed=12)
    state = s0.float().clone()
    ptr = state.data_ptr()
    o = K.kda_recurrent_step(*_f32(q, k, v, g, beta), state, dk**-0.5)
    o_ref, s_ref = _oracle([1] * b, q, k, v, g, beta, s0, dk**-0.5)
    assert state.data_ptr() == ptr and o.shape == (b, h, dv)
    _close(o, o_ref, STATE_TOL)
    _close(state, s_ref, STATE_TOL)
    buf = s0.float().transpose(0, 1).contiguous()  # non-contiguous [B, H, K, V] view
    view = buf.transpose(0, 1)
    o2 = K.kda_recurrent_step(*_f32(q, k, v, g, beta), view, dk**-0.5)
    torch.testing.assert_close(o2, o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buf.transpose(0, 1), state, rtol=1e-6, atol=1e-6)


def test_recurrent_step_loop_matches_chunked():
    b, t_len, h, d = 3, 70, 2, 16
    q, k, v, g, beta, s0 = _inputs([t_len] * b, h, d, d, g_lo=-2.0, seed=13)
    q, k, v, g, beta, s0 = _f32(q, k, v, g, beta, s0)
    o_c, s_c, _ = K.kda_chunked(q, k, v, g, beta, _cu([t_len] * b), 0.25, s0)
    state = s0.clone()
    per_seq = [x.view(b, t_len, *x.shape[1:]) for x in (q, k, v, g, beta)]
    outs = [K.kda_recurrent_step(*(x[:, t] for x in per_seq), state, 0.25) for t in range(t_len)]
    o_r = torch.stack(outs, 1).reshape(b * t_len, h, d)
    torch.testing.assert_close(o_r, o_c, **STATE_TOL)
    torch.testing.assert_close(state, s_c, **STATE_TOL)


def test_kda_chunked_gradients_match_recurrent_oracle():
    """Training differentiates the chunked prefill (its autograd scan); its gradients w.r.t. every
    input and the initial state equal those through the token-loop oracle, varlen, in fp64."""
    lens = [5, 70, 1, 33]
    q, k, v, g, beta, s0 = _inputs(lens, 2, 8, 4, seed=3)
    scale = 8**-0.5
    w_o = torch.randn(sum(lens), 2, 4, dtype=F64)
    w_s = torch.randn(len(lens), 2, 8, 4, dtype=F64)

    def grads(fn):
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, s0)]
        o, s = fn(*xs)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        return [x.grad for x in xs]

    got = grads(lambda *x: K.kda_chunked(*x[:5], _cu(lens), scale, x[5], chunk_size=16)[:2])
    want = grads(lambda *x: _oracle(lens, *x, scale))
    assert all(gr is not None and gr.abs().sum() > 0 for gr in got)
    for a, b in zip(got, want):
        _close(a, b, STATE_TOL)
