"""The Triton KDA kernels (`kernels.triton.kda`) and `TritonOps`' KDA methods against the float64
oracles of `ops.reference.kda` and the reference `TorchOps`, in fp32 on tiny shapes (CPU
interpreter, or CUDA where present). Bar: max error <= 1e-5 of the largest magnitude."""

import pytest
import torch

pytest.importorskip("triton")

from deltaserve.kernels.triton import kda as T  # noqa: E402
from deltaserve.ops import kda as K  # noqa: E402
from deltaserve.ops.backends import select  # noqa: E402
from deltaserve.ops.backends.torch import REFERENCE  # noqa: E402
from deltaserve.ops.backends.triton import TritonOps  # noqa: E402
from deltaserve.ops.operands import KdaSpec, KdaWeights  # noqa: E402
from deltaserve.ops.reference import kda as R  # noqa: E402

DECLINED = object()  # what `otherwise` answers: the backend declined its plan

pytestmark = pytest.mark.triton
F64 = torch.float64


def _close(got, ref, rel=1e-5):
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    assert got.shape == ref.shape
    scale = max(float(ref.abs().max()), 1e-30) if ref.numel() else 1.0
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * scale)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def _inputs(lens, h, dk, dv, g_lo, seed):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = K.l2_norm(torch.randn(n, h, dk, generator=gen))
    k = K.l2_norm(torch.randn(n, h, dk, generator=gen))
    v = torch.randn(n, h, dv, generator=gen)
    g = g_lo * torch.rand(n, h, dk, generator=gen)
    beta = torch.rand(n, h, generator=gen)
    s0 = 0.5 * torch.randn(len(lens), h, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


def _oracle(lens, q, k, v, g, beta, s0, scale, offsets):
    """Token-loop outputs, final states and the states after each export offset, in float64."""
    cu, outs, finals, saved = _cu(lens), [], [], []
    for b, n in enumerate(lens):
        a = int(cu[b])
        args = [t[a : a + n].double() for t in (q, k, v, g, beta)]
        init = None if s0 is None else s0[b].double()
        o, s = R.naive_recurrent_kda(*args, scale, init)
        outs.append(o)
        finals.append(s)
        for off in offsets[b] if offsets else []:
            saved.append(R.naive_recurrent_kda(*(t[:off] for t in args), scale, init)[1])
    exported = torch.stack(saved) if saved else None
    return torch.cat(outs), torch.stack(finals), exported


@pytest.mark.parametrize(
    "lens, chunk, dk, dv, g_lo, with_s0, offsets",
    [
        ([5, 37, 0, 20], 16, 16, 32, -1.0, True, [[1, 5], [3, 16, 17, 32, 37], [], [20]]),
        ([40], 16, 24, 16, -5.0, False, [[7, 8, 9, 39]]),  # strong decays, padded K
        ([70, 3], 64, 16, 16, -0.3, True, [[64, 65], [2]]),
        ([9, 12], 16, 16, 16, -1.0, True, None),
    ],
)
def test_chunked_prefill_exports_states_at_offsets(device, lens, chunk, dk, dv, g_lo, with_s0, offsets):
    q, k, v, g, beta, s0 = _inputs(lens, 2, dk, dv, g_lo, seed=sum(lens))
    s0 = s0 if with_s0 else None
    scale = dk**-0.5
    dev = [t.to(device) for t in (q, k, v, g, beta)]
    o, final, exported = T.chunk_kda(
        *dev, _cu(lens).to(device), scale, None if s0 is None else s0.to(device), chunk, export_offsets=offsets
    )
    ref_o, ref_final, ref_exported = _oracle(lens, q, k, v, g, beta, s0, scale, offsets)
    _close(o, ref_o)
    _close(final, ref_final)
    if offsets is None:
        assert exported is None
    else:
        _close(exported, ref_exported)
        fast = K.kda_chunked(q, k, v, g, beta, _cu(lens), scale, s0, chunk, export_offsets=offsets)
        _close(exported, fast[2])


def test_empty_export_lists_and_empty_batch(device):
    q, k, v, g, beta, s0 = (t.to(device) for t in _inputs([6, 4], 1, 16, 16, -1.0, seed=3))
    _, final, exported = T.chunk_kda(q, k, v, g, beta, _cu([6, 4]), 0.25, s0, 16, export_offsets=[[], []])
    assert exported.shape == (0, 1, 16, 16)
    _close(final, K.kda_chunked(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), _cu([6, 4]), 0.25, s0.cpu())[1])
    o, final, _ = T.chunk_kda(q[:0], k[:0], v[:0], g[:0], beta[:0], _cu([0, 0]), 0.25, s0, 16)
    assert o.shape == (0, 1, 16) and torch.equal(final.cpu(), s0.cpu())


def test_plan_reuse_never_serves_a_stale_plan(device):
    """Layers of one step share one plan; other offsets or other boundaries (even in the same
    tensor, changed in place) plan afresh."""
    q, k, v, g, beta, s0 = (t.to(device) for t in _inputs([10, 10], 1, 16, 16, -1.0, seed=4))
    cu = _cu([10, 10]).to(device)
    for offsets in ([[3], [10]], [[3], [10]], [[7], [2, 5]]):
        got = T.chunk_kda(q, k, v, g, beta, cu, 0.25, s0, 16, export_offsets=offsets)
        ref = K.kda_chunked(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu.cpu(), 0.25, s0.cpu(), 16, offsets)
        for a, b in zip(got, ref):
            _close(a, b)
    cu[1] = 4
    got = T.chunk_kda(q, k, v, g, beta, cu, 0.25, s0, 16, export_offsets=[[4], [16]])
    ref = K.kda_chunked(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), cu.cpu(), 0.25, s0.cpu(), 16, [[4], [16]])
    for a, b in zip(got, ref):
        _close(a, b)


@pytest.mark.parametrize(
    "gate, bound, dtype",
    [
        (T.GATE_SIGMOID, -5.0, torch.float32),
        (T.GATE_SOFTPLUS, 0.0, torch.float32),
        (T.GATE_GIVEN, 0.0, torch.float32),
        (T.GATE_SIGMOID, -5.0, torch.bfloat16),  # bf16 activations and tails: no tl.dot involved
    ],
)
def test_decode_step_over_slot_ids_in_place(device, gate, bound, dtype):
    """The pool rows of `slots` step in place (others untouched); math in fp32 on the same inputs."""
    gen = torch.Generator().manual_seed(gate)
    b, h, dk, dv, slots_n, w = 3, 2, 16, 32, 6, 4
    c = 2 * h * dk + h * dv
    tails = torch.randn(slots_n, w - 1, c, generator=gen).to(dtype)
    states = torch.randn(slots_n, h, dk, dv, generator=gen)
    x, weight = torch.randn(b, c, generator=gen).to(dtype), torch.randn(c, w, generator=gen)
    f, a_log, dt = (
        torch.randn(b, h * dk, generator=gen),
        torch.randn(h, generator=gen),
        torch.randn(h * dk, generator=gen),
    )
    beta, slots = torch.rand(b, h, generator=gen), torch.tensor([4, 0, 2])
    if gate == T.GATE_GIVEN:
        f = -torch.rand(b, h * dk, generator=gen)
    pool_t, pool_s, d_slots = tails.to(device, copy=True), states.to(device, copy=True), slots.to(device)
    y = T.conv_step(x.to(device), weight.to(device), pool_t, d_slots)
    o = T.recurrent_step(y, f.to(device), beta.to(device), pool_s, d_slots, 0.3, h, gate, a_log.to(device),
                         dt.to(device), bound)  # fmt: skip
    ref_y, ref_tail = K.causal_conv1d_step(x, weight, tails[slots])
    q, k, v = ref_y[:, : h * dk].view(b, h, dk), ref_y[:, h * dk : 2 * h * dk].view(b, h, dk), ref_y[:, 2 * h * dk :]
    fv = f.view(b, h, dk)
    g = {T.GATE_SIGMOID: lambda: K.kda_gate_sigmoid(fv, a_log, dt, bound), T.GATE_GIVEN: lambda: fv}.get(
        gate, lambda: K.kda_gate_softplus(fv, a_log, dt)
    )()
    ref_s = states[slots].clone()
    ref_o = K.kda_recurrent_step(K.l2_norm(q), K.l2_norm(k), v.reshape(b, h, dv), g, beta, ref_s, 0.3)
    _close(y, ref_y)
    _close(o, ref_o)
    assert torch.equal(pool_t[d_slots].cpu(), ref_tail)
    _close(pool_s[d_slots], ref_s)
    rest = torch.tensor([1, 3, 5])
    assert torch.equal(pool_t[rest.to(device)].cpu(), tails[rest]) and torch.equal(
        pool_s[rest.to(device)].cpu(), states[rest]
    )


def _layer(h, dk, d, lower_bound, seed):
    gen = torch.Generator().manual_seed(seed)
    p = h * dk

    def rnd(*s, scale=0.3):
        return scale * torch.randn(*s, generator=gen)

    w = KdaWeights(
        rnd(p, d), rnd(p, d), rnd(p, d), rnd(dk, d), rnd(p, dk), rnd(h, d), rnd(dk, d), rnd(p, dk), rnd(d, p),
        conv=rnd(3 * p, 4, scale=0.5), a_log=rnd(h), dt_bias=rnd(p), norm=1 + rnd(dk),
    )  # fmt: skip
    return w, KdaSpec(h, dk, lower_bound, 1e-5, dk**-0.5)


def _attend_args(ops, w, spec, x):
    n = x.shape[0]
    pre = torch.cat(ops.linears(x, [w.q, w.k, w.v]), -1)
    f = ops.linear(ops.linear(x, w.f_a), w.f_b)
    beta = torch.sigmoid(ops.linear(x, w.b).float())
    gate = ops.linear(ops.linear(x, w.g), w.g_b).view(n, spec.heads, spec.head_dim)
    return pre, f, beta, gate, w.conv, w.a_log, w.dt_bias, w.norm, spec


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_backend_prefill_then_pool_decode_match_the_reference(device, lower_bound):
    """`kda_attend` (prefill with prior state and exports, then a step) and `kda_decode` over the
    pool in place equal the reference `TorchOps` path."""
    h, dk, d = 2, 16, 24
    w, spec = _layer(h, dk, d, lower_bound, seed=7)
    ops = TritonOps()
    wd = KdaWeights(*(t.to(device) if t is not None else None for t in w.__dict__.values()))
    cu = _cu([9, 21])
    x = torch.randn(30, d, generator=torch.Generator().manual_seed(1))
    prior = (torch.randn(2, 3, 3 * h * dk), 0.5 * torch.randn(2, h, dk, dv := dk))  # never updated in place
    offsets = [[4, 9], [1, 17]]
    ref = REFERENCE.kda_attend(*_attend_args(REFERENCE, w, spec, x), cu, (prior[0], prior[1].clone()), offsets, False)
    got = ops.kda_attend(
        *_attend_args(ops, wd, spec, x.to(device)),
        cu.to(device),
        tuple(t.to(device, copy=True) for t in prior),
        offsets,
        False,
    )
    for a, b in zip(got[:3], ref[:3]):
        _close(a, b)
    for a, b in zip(got[3], ref[3]):
        _close(a, b)
    step_x = torch.randn(2, d, generator=torch.Generator().manual_seed(2))
    ref_step = REFERENCE.kda_attend(
        *_attend_args(REFERENCE, w, spec, step_x), _cu([1, 1]), (ref[1], ref[2].clone()), None, True
    )
    got_step = ops.kda_attend(
        *_attend_args(ops, wd, spec, step_x.to(device)), _cu([1, 1]), (got[1], got[2].clone()), None, True
    )
    for a, b in zip(got_step[:3], ref_step[:3]):
        _close(a, b)
    slots = torch.tensor([3, 1])
    tails, states = torch.zeros(4, 3, 3 * h * dk), torch.zeros(4, h, dk, dv)
    tails[slots], states[slots] = ref[1], ref[2]
    pool = (tails.to(device), states.to(device), slots.to(device))
    out = ops.kda_decode(step_x.to(device), ops.prepare_kda(wd, spec), pool, lambda: DECLINED)
    _close(out, REFERENCE.linear(ref_step[0].reshape(2, h * dk), w.o))
    _close(pool[0][pool[2]], ref_step[1])
    _close(pool[1][pool[2]], ref_step[2])
    assert not pool[1][torch.tensor([0, 2]).to(device)].any()
    assert ops.kda_decode(step_x.to(device), None, pool, lambda: DECLINED) is DECLINED


def test_selection_is_explicit_and_reported(monkeypatch):
    monkeypatch.setenv("DELTASERVE_TRITON", "1")
    ops = select.select_ops("cpu", torch.float32)
    assert (
        isinstance(ops, TritonOps) and "triton: " in select.describe(ops) and ops.describe()["kda"].startswith("triton")
    )
    monkeypatch.setenv("DELTASERVE_TRITON", "0")
    assert select.select_ops("cpu", torch.float32) is REFERENCE
    monkeypatch.setenv("DELTASERVE_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            select.select_ops("cpu", torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="half-precision tl.dot needs CUDA (wrong in the interpreter)")
def test_tf32_prefill_and_fla_where_it_imports_stay_close():
    """On CUDA: our kernel with TF32 dots and, where fla-core imports, its prefill with bf16 inputs,
    against the fp32 PyTorch path (half-precision bars)."""
    from deltaserve.kernels.extern import fla_kda

    lens = [300, 77]
    q, k, v, g, beta, s0 = (t.cuda() for t in _inputs(lens, 4, 64, 64, -1.0, seed=5))
    cu = _cu(lens).cuda()
    ref_o, ref_s, _ = K.kda_chunked(q, k, v, g, beta, cu, 0.125, s0)
    o, s, ex = T.chunk_kda(q, k, v, g, beta, cu, 0.125, s0, export_offsets=[[64, 100], [1]], precision="tf32")
    _close(o, ref_o, 2e-3)
    _close(s, ref_s, 2e-3)
    assert ex.shape == (3, 4, 64, 64)
    if fla_kda.available():
        assert fla_kda.fits(q, torch.bfloat16, None) and not fla_kda.fits(q, torch.bfloat16, [[64], []])
        o, s = fla_kda.chunk_kda(q, k, v, g, beta, cu, 0.125, s0, dtype=torch.bfloat16)
        _close(o, ref_o, 3e-2)
        _close(s, ref_s, 3e-2)
