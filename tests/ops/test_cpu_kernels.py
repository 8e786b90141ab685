"""Native CPU kernels (kernels/cpu, csrc/*.c) against the PyTorch paths they replace.

Tolerances: both sides accumulate in fp32 and round once to bf16, so outputs agree to about one
bf16 ulp of the result (summation order differs); where the orders coincide they are equal.
Skipped only where the kernels cannot be built (no C compiler)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.ops import kda as kda_ops
from deltaserve.ops.activations import silu_and_mul, situ_and_mul
from deltaserve.ops.backends.cpu import CpuNativeOps
from deltaserve.ops.backends.select import select_ops
from deltaserve.ops.backends.torch import REFERENCE
from deltaserve.ops.mla import lse_combine, mla_absorbed_attention, mla_absorbed_partial
from deltaserve.ops.moe import grouped_experts
from deltaserve.ops.mxfp4 import mxfp4_decode, mxfp4_encode
from deltaserve.ops.norms import gated_rms_norm

NK = cpu_kernels.native()
needs_kernels = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable (no C compiler)")
linear = CpuNativeOps(NK).linear if NK is not None else None  # the backend's dispatch
BF = torch.bfloat16


def ulps(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |a - b| in units of bf16 spacing at |ref| (floored at the tensor's rms)."""
    scale = torch.maximum(ref.float().abs(), ref.float().pow(2).mean().sqrt())
    return float(((a.float() - b.float()).abs() / (scale * 2.0**-7)).max())


def packed_experts(e, o, i, gen):
    ps, ss = zip(*[mxfp4_encode(torch.randn(o, i, generator=gen) * 0.1) for _ in range(e)])
    return torch.stack(ps), torch.stack(ss)


def routed_case(n, gen, e=8, inter=64, d=96, k=4):
    """Random MXFP4 experts ((w1, w3, w2) packed and decoded to bf16), x [n, d], ids and weights [n, k]."""
    packed = packed_experts(e, inter, d, gen), packed_experts(e, inter, d, gen), packed_experts(e, d, inter, gen)
    dense = [torch.stack([mxfp4_decode(p[j], s[j], BF) for j in range(e)]) for p, s in packed]
    x = torch.randn(n, d, generator=gen).to(BF)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    return packed, dense, x, ids, torch.rand(n, k, generator=gen)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k", [64, 1000])
def test_linear_bf16_matches_f_linear(rows, k):
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen).to(BF)
    w = torch.randn(300, k, generator=gen).to(BF)
    ref = F.linear(x, w)
    got = NK.linear_bf16(x, w)
    assert got.dtype == BF and got.shape == ref.shape
    assert ulps(got, ref, ref) <= 2.0
    assert torch.equal(linear(x, w), got)  # dispatch takes the native path
    big = torch.randn(NK.multi_rows(k) + 1, k, generator=gen).to(BF)
    assert torch.equal(linear(big, w), F.linear(big, w))  # above the native kernels' rows: torch


@needs_kernels
def test_argmax_rows_is_torchs_choice():
    """The first largest value's index, a NaN counting as the largest (the first NaN), a row of -inf
    at 0; rows of 1, 17 and 4099 columns (vector body and scalar tail), 1 and 9 rows."""
    gen = torch.Generator().manual_seed(9)
    for n, v in [(1, 1), (1, 17), (9, 4099), (3, 64)]:
        x = torch.randn(n, v, generator=gen)
        if v >= 17:
            x[0, 3] = x[0, v - 2] = x[0].max() + 1  # a tie: the earlier one
            x[-1, v // 2] = float("nan")
            x[-1, v - 1] = float("nan")
        if n >= 3:
            x[1] = float("-inf")
        assert torch.equal(NK.argmax_rows(x), x.argmax(dim=-1)), (n, v)
    with pytest.raises(ValueError):
        NK.argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16))
    ops = CpuNativeOps(NK)
    y = torch.randn(4, 100, generator=gen)
    assert torch.equal(ops.argmax_rows(y), REFERENCE.argmax_rows(y))
    assert torch.equal(ops.argmax_rows(y.bfloat16()), y.bfloat16().argmax(-1))  # not fp32: torch's


@needs_kernels
def test_linear_rejects_bad_operands():
    with pytest.raises(ValueError):
        NK.linear_bf16(torch.zeros(9, 32, dtype=BF), torch.zeros(4, 32, dtype=BF))
    with pytest.raises(ValueError):
        NK.linear_bf16(torch.zeros(1, 32), torch.zeros(4, 32))


@needs_kernels
def test_mxfp4_dequant_is_exact():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=gen) * torch.logspace(-3, 3, 96).unsqueeze(1)
    packed, scale = mxfp4_encode(w)
    dense = mxfp4_decode(packed, scale, BF)
    assert torch.equal(NK.mxfp4_to_bf16(packed, scale), dense)
    stacked = NK.mxfp4_to_bf16(packed.view(2, 48, 128), scale.view(2, 48, 8))
    assert torch.equal(stacked.view(96, 256), dense)


@needs_kernels
@pytest.mark.parametrize("act_kind", [cpu_kernels.ACT_SITU, cpu_kernels.ACT_SILU])
@pytest.mark.parametrize("n", [1, 3, 11])
def test_fused_moe_matches_grouped_experts(act_kind, n):
    (w1, w3, w2), dense, x, ids, wts = routed_case(n, torch.Generator().manual_seed(n))
    if act_kind == cpu_kernels.ACT_SITU:
        act, beta, lbeta = functools.partial(situ_and_mul, beta=4.0, linear_beta=25.0), 4.0, 25.0
    else:
        act, beta, lbeta = silu_and_mul, 0.0, None
    ref = grouped_experts(x, ids, wts, *dense, act)
    from_packed = NK.moe_experts(x, ids, wts, w1, w3, w2, act_kind, beta, lbeta)
    from_dense = NK.moe_experts(x, ids, wts, *dense, act_kind, beta, lbeta)
    assert torch.equal(from_packed, from_dense)  # decode-on-the-fly == decode-then-multiply
    assert ulps(from_dense, ref, ref) <= 2.0
    with pytest.raises(ValueError):
        NK.moe_experts(x, ids + 8, wts, *dense, act_kind, beta, lbeta)


@needs_kernels
@pytest.mark.parametrize("act_kind", [cpu_kernels.ACT_SITU, cpu_kernels.ACT_SILU])
def test_batch1_experts_equal_the_batched_kernels_rows(act_kind):
    """One token takes its own kernel (moe_row.c: one parallel region); with the GEMV path for the
    batch (AMX off), each token's result must be the batched call's row, bit for bit."""
    (w1, w3, w2), dense, x, ids, wts = routed_case(5, torch.Generator().manual_seed(7), e=16, inter=96, k=6)
    beta, lbeta = (4.0, 25.0) if act_kind == cpu_kernels.ACT_SITU else (0.0, None)
    old = NK.set_amx(False)
    try:
        for weights in ((w1, w3, w2), dense):
            batched = NK.moe_experts(x, ids, wts, *weights, act_kind, beta, lbeta)
            for t in range(x.shape[0]):
                one = NK.moe_experts(x[t : t + 1], ids[t : t + 1], wts[t : t + 1], *weights, act_kind, beta, lbeta)
                assert torch.equal(one, batched[t : t + 1])
    finally:
        NK.set_amx(old)
    with pytest.raises(ValueError):
        NK.moe_experts(x[:1], ids[:1] + 16, wts[:1], *dense, act_kind, beta, lbeta)


def _kda_torch(q, k, v, conv_w, tails, states, f, a_log, dt_bias, b, gate, norm_w, eps, scale, heads, softplus=False):
    """The PyTorch decode path of KdaAttention on copies of the slot state (K3's sigmoid gate with lower
    bound -5, or Kimi-Linear's softplus gate)."""
    n, p = q.shape
    dk = p // heads
    mixed, new_tail = kda_ops.causal_conv1d_step(torch.cat([q, k, v], -1), conv_w, tails.clone())
    qq, kk, vv = mixed.view(n, 3, heads, dk).unbind(1)
    qq, kk = kda_ops.l2_norm(qq), kda_ops.l2_norm(kk)
    if softplus:
        g = kda_ops.kda_gate_softplus(f.view(n, heads, dk), a_log, dt_bias)
    else:
        g = kda_ops.kda_gate_sigmoid(f.view(n, heads, dk), a_log, dt_bias, -5.0)
    st = states.clone()
    o = kda_ops.kda_recurrent_step(qq, kk, vv, g, torch.sigmoid(b.float()), st, scale)
    return gated_rms_norm(o, norm_w, gate.view(n, heads, dk), eps, BF).reshape(n, p), new_tail, st


@needs_kernels
@pytest.mark.parametrize("softplus", [False, True])
@pytest.mark.parametrize("heads, dk", [(2, 32), (3, 24), (1, 128)])  # 24: no 16-wide state path, a conv tail
def test_kda_decode_matches_torch_step_and_updates_slots_in_place(heads, dk, softplus):
    gen = torch.Generator().manual_seed(3)
    w, bsz, num_slots = 4, 3, 5
    p = heads * dk

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    q, k, v, f, gate = (rnd(bsz, p).to(BF) for _ in range(5))
    if softplus:  # both ends of the softplus: past torch's threshold (x itself) and far below zero
        f[0, :4], f[1, :4] = 30.0, -40.0
    b = rnd(bsz, heads).to(BF)
    conv_w, a_log, dt_bias, norm_w = rnd(3 * p, w) * 0.5, rnd(heads) * 0.3, rnd(p) * 0.3, 1 + 0.1 * rnd(dk)
    tails = rnd(num_slots, w - 1, 3 * p).to(BF)
    states = rnd(num_slots, heads, dk, dk) * 0.1
    slots = torch.tensor([4, 0, 2])
    ref, ref_tail, ref_state = _kda_torch(
        q,
        k,
        v,
        conv_w,
        tails[slots],
        states[slots],
        f,
        a_log,
        dt_bias,
        b,
        gate,
        norm_w,
        1e-5,
        dk**-0.5,
        heads,
        softplus,
    )
    untouched_t, untouched_s = tails[[1, 3]].clone(), states[[1, 3]].clone()
    got = NK.kda_decode(
        q,
        k,
        v,
        conv_w,
        tails,
        states,
        slots,
        f,
        a_log,
        dt_bias,
        cpu_kernels.GATE_SOFTPLUS if softplus else cpu_kernels.GATE_SIGMOID,
        0.0 if softplus else -5.0,
        b,
        gate,
        norm_w,
        1e-5,
        dk**-0.5,
    )
    assert ulps(got, ref, ref) <= 2.0
    assert torch.equal(tails[slots], ref_tail.to(BF))
    torch.testing.assert_close(states[slots], ref_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(tails[[1, 3]], untouched_t) and torch.equal(states[[1, 3]], untouched_s)


@needs_kernels
@pytest.mark.parametrize("heads, rank", [(4, 64), (8, 64), (12, 80)])  # per head; 8 a pass; 8 + 4, 80 = 64 + 16
def test_mla_decode_matches_absorbed_attention_over_scattered_rows(heads, rank):
    gen = torch.Generator().manual_seed(5)
    rope = 16
    d = rank + rope
    lens = [1, 300, 700]  # > one 256-row chunk: the split-merge path runs (chunks of 160 + 140, 3 x ~240)
    pool = torch.randn(2048, d, generator=gen).to(BF)
    perm = torch.randperm(2048, generator=gen)
    read_rows = perm[: sum(lens)]
    cu_kv = torch.tensor([0, *lens]).cumsum(0)
    q = torch.randn(len(lens), heads, d, generator=gen).to(BF)
    got = NK.mla_decode(q, pool, read_rows, cu_kv, rank, d**-0.5)
    ref = mla_absorbed_attention(q, pool[read_rows], torch.arange(len(lens) + 1), cu_kv, rank, d**-0.5)
    assert got.shape == ref.shape == (len(lens), heads, rank)
    assert ulps(got, ref, ref) <= 2.0
    with pytest.raises(ValueError):
        NK.mla_decode(q, pool, read_rows + 2048, cu_kv, rank, 1.0)


@needs_kernels
def test_mla_decode_partial_is_the_partial_attention_of_a_share():
    """Decode context parallelism: each of three shares of every context (positions t % 3) gives the
    fp32 (o, lse) of `mla_absorbed_partial` for one query per sequence at its last position (a
    sequence with no row in a share: o = 0, lse = -inf), and merging the shares by LSE gives the
    whole context's attention."""
    gen = torch.Generator().manual_seed(9)
    heads, rank, rope = 8, 64, 16
    d, lens, scale = rank + rope, [2, 300, 700], (rank + rope) ** -0.5
    pool = torch.randn(2048, d, generator=gen).to(BF)
    read_rows = torch.randperm(2048, generator=gen)[: sum(lens)]
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()[:-1]]
    q = torch.randn(len(lens), heads, d, generator=gen).to(BF)
    q_pos, cu_q = torch.tensor(lens) - 1, torch.arange(len(lens) + 1)
    parts = []
    for share in range(3):
        pos = [torch.arange(share, n, 3) for n in lens]
        rows = torch.cat([read_rows[s + p] for s, p in zip(starts, pos)])
        cu = torch.tensor([0, *[len(p) for p in pos]]).cumsum(0)
        o, lse = NK.mla_decode_partial(q, pool, rows, cu, rank, scale)
        ref_o, ref_lse = mla_absorbed_partial(q, pool[rows], q_pos, torch.cat(pos), cu_q, cu, rank, scale)
        assert o.dtype == lse.dtype == torch.float32 and o.shape == ref_o.shape and lse.shape == ref_lse.shape
        empty = torch.isinf(ref_lse)
        assert empty.any() == (share == 2)  # the 2-token sequence has no position 2
        assert torch.equal(torch.isinf(lse), empty) and (o[empty] == 0).all()
        torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-3 * ref_o.abs().max().item())  # bf16 weights
        torch.testing.assert_close(lse[~empty], ref_lse[~empty], rtol=0, atol=1e-5)
        parts.append((o, lse))
    merged, _ = lse_combine(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    whole = mla_absorbed_attention(q, pool[read_rows], cu_q, torch.tensor([0, *lens]).cumsum(0), rank, scale)
    assert ulps(merged.to(BF), whole, whole) <= 2.0


@needs_kernels
def test_backend_selection():
    """bf16 on CPU binds the native backend; fp32, or disabled kernels, the reference."""
    assert isinstance(select_ops("cpu", BF), CpuNativeOps)
    assert select_ops("cpu", torch.float32) is REFERENCE
    old = cpu_kernels.set_enabled(False)
    try:
        assert cpu_kernels.native() is None and select_ops("cpu", BF) is REFERENCE
        x, w = torch.randn(1, 64).to(BF), torch.randn(8, 64).to(BF)
        assert torch.equal(REFERENCE.linear(x, w), F.linear(x, w))
    finally:
        cpu_kernels.set_enabled(old)


def test_kernels_build_wherever_a_compiler_exists():
    """CI machines have gcc: the native paths must really be exercised there, not skipped."""
    import shutil

    if shutil.which("cc") or shutil.which("gcc"):
        assert NK is not None


@needs_kernels
def test_linear_bf16_heads_matches_bmm():
    gen = torch.Generator().manual_seed(9)
    for m in (1, 3, 8):
        x = torch.randn(4, m, 96, generator=gen).to(BF)
        w = torch.randn(4, 40, 96, generator=gen).to(BF)
        ref = torch.bmm(x, w.transpose(1, 2))
        got = NK.linear_bf16_heads(x, w)
        assert ulps(got, ref, ref) <= 2.0


@needs_kernels
@pytest.mark.parametrize("act_kind", [cpu_kernels.ACT_SITU, cpu_kernels.ACT_SILU])
def test_glu_matches_torch_activations(act_kind):
    gen = torch.Generator().manual_seed(11)
    g, u = (torch.randn(70, 33, generator=gen).mul(6).to(BF) for _ in range(2))
    ref = situ_and_mul(g, u, 4.0, 25.0) if act_kind == cpu_kernels.ACT_SITU else silu_and_mul(g, u)
    got = NK.glu_rows(g, u, act_kind, 4.0, 25.0 if act_kind == cpu_kernels.ACT_SITU else None)
    assert ulps(got, ref, ref) <= 1.0


def check_linear_multi(lib, rows: int, k: int, uses) -> list[torch.Tensor]:
    """`lib.linear_bf16_multi` over three weights (tails of 12, 0 and 7 rows past 16, one fp32
    output) against fp32 matmuls (fp32 output) and `F.linear` (within 2 bf16 ulps); `uses()`
    must grow (the tile path ran). Returns the outputs."""
    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    ws = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for n in (300, 16, 7)]
    before = uses()
    got = lib.linear_bf16_multi(x, ws, [False, True, False])
    assert uses() > before
    for w, y, f32 in zip(ws, got, [False, True, False]):
        ref = x.float() @ w.float().T
        assert y.dtype == (torch.float32 if f32 else torch.bfloat16) and y.shape == ref.shape
        if f32:
            assert torch.allclose(y, ref, rtol=1e-5, atol=1e-3 * k**0.5)
        else:
            assert ulps(y, torch.nn.functional.linear(x, w), ref) <= 2.0
    return x, ws, got
