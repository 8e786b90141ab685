"""Native chunked-KDA prefill and causal conv (csrc/kda_chunk.c via kernels.cpu.kda) against the
PyTorch ops in ops.kda and the float64 recurrent oracle in ops.reference.kda.

Tolerances: both fast paths run in fp32 with different summation orders (and the kernel's own
exp polynomial, ~1 ulp), so they agree to ~1e-6 on O(1) outputs and states; NATIVE_TOL (1e-4
relative, 1e-5 absolute) leaves a wide margin yet catches a wrong decay, order or offset. Conv
tails are copies and must match exactly. Skipped only where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.model import load_model
from deltaserve.model.context import DenseCache
from deltaserve.model.fused import bound_ops
from deltaserve.ops import kda as K
from deltaserve.ops.backends.torch import REFERENCE
from deltaserve.ops.reference import kda as R
from deltaserve.tiny import make_tiny
from tests.kernel_calls import count_kernel_calls

NK = cpu_kernels.native()
pytestmark = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable (no C compiler)")
NATIVE_TOL = dict(rtol=1e-4, atol=1e-5)
LENS = [1, 63, 64, 65, 200]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.long).cumsum(0).tolist())


def _inputs(lens, h, dk, dv, g_lo=-1.0, g_hi=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = K.l2_norm(torch.randn(n, h, dk, generator=gen))
    k = K.l2_norm(torch.randn(n, h, dk, generator=gen))
    v = torch.randn(n, h, dv, generator=gen)
    g = g_lo + (g_hi - g_lo) * torch.rand(n, h, dk, generator=gen)
    beta = torch.rand(n, h, generator=gen)
    s0 = 0.5 * torch.randn(len(lens), h, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


def _oracle(lens, q, k, v, g, beta, s0, scale):
    """float64 token loop per sequence: (o [N, H, V], final [B, H, K, V])."""
    cu, outs, states = _cu(lens), [], []
    for b in range(len(lens)):
        a, z = int(cu[b]), int(cu[b + 1])
        o, s = R.naive_recurrent_kda(*(t[a:z].double() for t in (q, k, v, g, beta)), scale, s0[b].double())
        outs.append(o)
        states.append(s)
    return torch.cat(outs), torch.stack(states)


def _close(actual, expected, tol=NATIVE_TOL):
    torch.testing.assert_close(actual.double(), expected.double(), **tol)


@pytest.mark.parametrize("h,dk,dv", [(2, 32, 32), (3, 24, 40), (1, 128, 128)])
def test_kda_chunked_varlen_matches_torch_and_oracle(h, dk, dv):
    q, k, v, g, beta, s0 = _inputs(LENS, h, dk, dv, seed=dk)
    cu, scale = _cu(LENS), dk**-0.5
    o, s, ex = NK.kda_chunked(q, k, v, g, beta, cu, scale, initial_state=s0)
    o_t, s_t, _ = K.kda_chunked(q, k, v, g, beta, cu, scale, initial_state=s0)
    assert ex is None and o.shape == o_t.shape and s.shape == s_t.shape
    _close(o, o_t)
    _close(s, s_t)
    o_r, s_r = _oracle(LENS, q, k, v, g, beta, s0, scale)
    _close(o, o_r)
    _close(s, s_r)


def test_kda_chunked_export_offsets_at_any_offset():
    lens, h, d = [1, 65, 0, 200], 2, 32
    q, k, v, g, beta, s0 = _inputs(lens, h, d, d, seed=3)
    offsets = [[1], [5, 63, 64, 65], [], [1, 17, 64, 100, 100, 129, 200]]
    args = (q, k, v, g, beta, _cu(lens), 0.3)
    o, s, ex = NK.kda_chunked(*args, initial_state=s0, export_offsets=offsets)
    o_t, s_t, ex_t = K.kda_chunked(*args, initial_state=s0, export_offsets=offsets)
    assert ex.shape == ex_t.shape == (sum(map(len, offsets)), h, d, d)
    _close(o, o_t)
    _close(s, s_t)
    _close(ex, ex_t)
    cu = _cu(lens)
    _, s_pre = R.naive_recurrent_kda(
        *(t[int(cu[3]) : int(cu[3]) + 129].double() for t in (q, k, v, g, beta)), 0.3, s0[3].double()
    )
    _close(ex[1 + 4 + 5], s_pre)  # sequence 3's offset 129
    _, _, none = NK.kda_chunked(*args, export_offsets=[[] for _ in lens])
    assert none.shape == (0, h, d, d)


@pytest.mark.parametrize("g_lo,g_hi", [(-40.0, -20.0), (-5.0, -4.9), (-1e-3, 0.0)])
def test_kda_chunked_extreme_gates(g_lo, g_hi):
    q, k, v, g, beta, s0 = _inputs(LENS, 2, 32, 32, g_lo, g_hi, seed=8)
    o, s, _ = NK.kda_chunked(q, k, v, g, beta, _cu(LENS), 0.2, initial_state=s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_r, s_r = _oracle(LENS, q, k, v, g, beta, s0, 0.2)
    _close(o, o_r)
    _close(s, s_r)


def test_kda_chunked_subnormal_regime_restores_fp_mode():
    """Gates of -5*sigmoid (K3) over long chunks make products of decays and W entries subnormal;
    the kernel flushes them for the call only: results match the oracle and the caller's thread
    still produces subnormals afterwards."""
    lens = [200, 64]
    q, k, v, _, beta, s0 = _inputs(lens, 2, 64, 64, seed=13)
    g = -5 * torch.sigmoid(torch.randn(sum(lens), 2, 64, generator=torch.Generator().manual_seed(14)))
    o, s, _ = NK.kda_chunked(q, k, v, g, beta, _cu(lens), 0.125, initial_state=s0)
    o_r, s_r = _oracle(lens, q, k, v, g, beta, s0, 0.125)
    _close(o, o_r)
    _close(s, s_r)
    assert (torch.tensor([1e-38]) / 10).item() > 0


@pytest.mark.parametrize("softplus", [False, True])
def test_kda_chunked_gate_regimes_mixed_decay(softplus):
    """Real gate functions over logits spanning +-30: per-channel decays from ~0 to -70 within
    one chunk (softplus is unbounded below), channels decaying at very different rates."""
    h, d = 2, 32
    q, k, v, _, beta, s0 = _inputs(LENS, h, d, d, seed=11)
    gen = torch.Generator().manual_seed(12)
    f = 15 * torch.randn(sum(LENS), h, d, generator=gen)
    a_log, dt = torch.tensor([0.3, 0.9]), torch.randn(h * d, generator=gen)
    g = K.kda_gate_softplus(f, a_log, dt) if softplus else K.kda_gate_sigmoid(f, a_log, dt)
    if softplus:
        assert float(g.min()) < -40
    o, s, _ = NK.kda_chunked(q, k, v, g, beta, _cu(LENS), 0.2, initial_state=s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_r, s_r = _oracle(LENS, q, k, v, g, beta, s0, 0.2)
    _close(o, o_r)
    _close(s, s_r)


@pytest.mark.parametrize("chunk", [1, 16, 37, 64])
def test_kda_chunked_strided_inputs_and_chunk_sizes(chunk):
    """q, k, v as views of one [N, 3, H, K] conv output (token stride 3HK), no initial state."""
    lens, h, d = [70, 3, 130], 2, 32
    q, k, v, g, beta, _ = _inputs(lens, h, d, d, seed=chunk)
    mixed = torch.stack([q, k, v], 1).reshape(sum(lens), 3 * h * d)
    qs, ks, vs = mixed.view(-1, 3, h, d).unbind(1)
    assert qs.stride(0) == 3 * h * d
    o, s, _ = NK.kda_chunked(qs, ks, vs, g, beta, _cu(lens), 0.25, chunk_size=chunk)
    o_t, s_t, _ = K.kda_chunked(q, k, v, g, beta, _cu(lens), 0.25)
    _close(o, o_t)
    _close(s, s_t)


def test_kda_chunked_rejects_bad_operands():
    q, k, v, g, beta, _ = _inputs([4, 5], 2, 16, 16)
    cu = _cu([4, 5])
    with pytest.raises(ValueError):
        NK.kda_chunked(q.double(), k, v, g, beta, cu, 0.25)
    with pytest.raises(ValueError):
        NK.kda_chunked(q, k, v, g, beta, torch.tensor([0, 4, 8]), 0.25)
    with pytest.raises(ValueError):
        NK.kda_chunked(q, k, v, g, beta, cu, 0.25, export_offsets=[[5], []])
    with pytest.raises(ValueError):
        NK.kda_chunked(q, k, v, g, beta, cu, 0.25, chunk_size=128)


@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_causal_conv1d_matches_torch_and_oracle(with_tail, width):
    lens, c = [1, 2, 63, 0, 65, 9], 48
    gen = torch.Generator().manual_seed(width)
    n = sum(lens)
    wide = torch.randn(n, 2 * c, generator=gen).bfloat16()
    x = wide[:, :c]  # strided rows
    w = torch.randn(c, width, generator=gen)
    tail0 = torch.randn(len(lens), width - 1, c, generator=gen).bfloat16() if with_tail else None
    y, tail = NK.causal_conv1d(x, w, _cu(lens), tail0)
    y_t, tail_t = K.causal_conv1d(x, w, _cu(lens), tail0)
    assert tail.dtype == torch.bfloat16 and torch.equal(tail, tail_t)
    _close(y, y_t, dict(rtol=1e-5, atol=1e-6))
    cu = _cu(lens)
    for b in range(len(lens)):
        a, z = int(cu[b]), int(cu[b + 1])
        y_r, tail_r = R.naive_causal_conv1d(x[a:z].double(), w.double(), None if tail0 is None else tail0[b].double())
        _close(y[a:z], y_r, dict(rtol=1e-5, atol=1e-6))
        assert torch.equal(tail[b].double(), tail_r)


def test_causal_conv1d_fused_l2_norm():
    lens, h, d = [5, 70], 3, 32
    gen = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(sum(lens), 3 * h * d, generator=gen)).bfloat16()
    w = torch.randn(3 * h * d, 4, generator=gen)
    tail0 = torch.randn(2, 3, 3 * h * d, generator=gen).bfloat16()
    y, tail = NK.causal_conv1d(x, w, _cu(lens), tail0, l2_groups=2 * h, group=d)
    y_t, tail_t = K.causal_conv1d(x, w, _cu(lens), tail0)
    n = sum(lens)
    qk = K.l2_norm(y_t[:, : 2 * h * d].reshape(n, 2 * h, d)).reshape(n, -1)
    _close(y, torch.cat([qk, y_t[:, 2 * h * d :]], 1), dict(rtol=1e-5, atol=1e-6))
    assert torch.equal(tail, tail_t)
    with pytest.raises(ValueError):
        NK.causal_conv1d(x.float(), w, _cu(lens))
    with pytest.raises(ValueError):
        NK.causal_conv1d(x, w, _cu(lens), l2_groups=3 * h + 1, group=d)


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def tiny_dir(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), family=request.param, preset="tiny", seed=3)


def _count_native(monkeypatch):
    return count_kernel_calls(monkeypatch, ("kda_chunked", "causal_conv1d", "kda_gate_sigmoid", "gated_rms_norm"))


@torch.inference_mode()
def _layer_steps(layer, x, offsets):
    """Two packed sequences through one KDA layer in two uneven steps (the second from cached
    tails and states), exporting tails/states at interior offsets in the second."""
    cache = DenseCache(2)
    outs = [layer(x[:90], cache.begin([70, 20]))]
    cache.end()
    outs.append(layer(x[90:], cache.begin([30, 13], export_offsets=offsets)))
    cache.end()
    tail, state = cache.kda[layer.layer_id]
    return outs, tail, state, cache.exports[layer.layer_id]


def _on_off(model, fn, *args):
    """fn(*args) on the model's native backend, then on the reference."""
    got = fn(*args)
    with bound_ops(model, REFERENCE):
        return got, fn(*args)


def test_layer_bf16_prefill_native_matches_torch_and_engages(tiny_dir, monkeypatch):
    """Every KDA layer of a bf16 model: outputs within bf16 rounding noise, identical conv tails
    (copies), fp32 states and exported states within fp32 tolerance, on both paths."""
    model = load_model(tiny_dir, dtype=torch.bfloat16, progress=False)
    layers = [m for m in model.modules() if type(m).__name__ == "KdaAttention"]
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(133, model.config.hidden_size, generator=gen).bfloat16()
    calls = _count_native(monkeypatch)
    for layer in layers:
        (outs, tail, state, ex), (outs_t, tail_t, state_t, ex_t) = _on_off(
            model, _layer_steps, layer, x, [[7, 30], [13]]
        )
        for a, b in zip(outs, outs_t):
            assert a.dtype == torch.bfloat16
            scale = b.float().pow(2).mean().sqrt()
            assert float((a.float() - b.float()).abs().max()) <= 4 * 2.0**-8 * float(b.float().abs().max() + scale)
        assert tail.dtype == torch.bfloat16 and torch.equal(tail, tail_t) and torch.equal(ex[0], ex_t[0])
        _close(state, state_t)
        _close(ex[1], ex_t[1])
    assert calls["kda_chunked"] == calls["causal_conv1d"] == calls["gated_rms_norm"] == 2 * len(layers) > 0, calls
    sigmoid_gates = sum(layer.lower_bound is not None for layer in layers)  # K3's gate; Kimi-Linear's is softplus
    assert calls["kda_gate_sigmoid"] == 2 * sigmoid_gates, calls


def test_model_bf16_forward_native_within_bf16_noise(tiny_dir, monkeypatch):
    """Whole bf16 forward: native vs PyTorch logits differ less than bf16 differs from fp32."""
    model = load_model(tiny_dir, dtype=torch.bfloat16, progress=False)
    ids = torch.randint(0, model.config.vocab_size, (100,), generator=torch.Generator().manual_seed(4))
    calls = _count_native(monkeypatch)
    with torch.inference_mode():
        full, full_t = (t.float() for t in _on_off(model, model.forward_full, ids))
        exact = load_model(tiny_dir, dtype=torch.float32, progress=False).forward_full(ids)
    assert calls["kda_chunked"] > 0 and torch.isfinite(full).all()
    assert float((full - full_t).abs().mean()) < float((full_t - exact).abs().mean())
