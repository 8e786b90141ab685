"""Triton KDA kernels: chunked prefill over packed varlen sequences that exports the recurrent
state at any list of requested offsets inside the one pass, and the fused recurrent decode step
over the state slot pool (conv tail and state updated in place).

Contracts are those of `ops.kda` (`kda_chunked`, `kda_recurrent_step`, `causal_conv1d_step`):
same shapes, fp32 math and outputs, and the same chunk plan (`kernels.chunking.chunk_plan`), so
chunks are cut at the export offsets and the state at the end of such a chunk is the export.

Prefill runs two kernels. `_intra` (one program per chunk and head) forms the WY/UT quantities
of spec/model.md §6.3: each pairwise decay exp(G_i - G_j) is built from a running sum of the
g between j and i (never a difference of cumulative sums), so every exponent is <= 0 and has no
cancellation; (I + L)^-1 by forward substitution. `_inter` (one program per sequence, head and
value block) walks that sequence's chunks in order, writes the outputs and stores the state at
every chunk that ends on an export offset, then the final state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...kernels.chunking import checked_cu_seqlens, chunk_plan, excl_cumsum
from .sizes import pow2

GATE_GIVEN, GATE_SIGMOID, GATE_SOFTPLUS = 0, 1, 2


@triton.jit
def _intra(q, k, v, g, beta, starts, lens, w_out, u_out, qg_out, kd_out, aqk_out, egc_out, scale,
           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    c, h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(starts + c).to(tl.int64)
    n = tl.load(lens + c)
    r = tl.arange(0, BT)
    rm = r < n
    base = (c * H + h).to(tl.int64)
    b_beta = tl.load(beta + (t0 + r) * H + h, mask=rm, other=0.0).to(tl.float32)
    akk = tl.zeros([BT, BT], dtype=tl.float32)
    aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in tl.static_range(0, KP, BK):
        cols = k0 + tl.arange(0, BK)
        m2 = rm[:, None] & (cols[None, :] < K)
        off = (t0 + r[:, None]) * (H * K) + h * K + cols[None, :]
        b_q = tl.load(q + off, mask=m2, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + off, mask=m2, other=0.0).to(tl.float32)
        b_g = tl.load(g + off, mask=m2, other=0.0).to(tl.float32)
        tl.store(qg_out + base * BT * KP + r[:, None] * KP + cols[None, :], b_q * tl.exp(tl.cumsum(b_g, 0)))
        tl.store(egc_out + base * KP + cols, tl.exp(tl.sum(b_g, 0)))
        d = tl.zeros([BT, BK], dtype=tl.float32)  # column j: sum of g over (j, i] in row i
        kd = tl.zeros([BT, BK], dtype=tl.float32)
        for jj in range(BT):
            j = BT - 1 - jj
            mj = (cols < K) & (cols * 0 + j < n)
            row = (t0 + j) * (H * K) + h * K + cols
            k_j = tl.load(k + row, mask=mj, other=0.0).to(tl.float32)
            g_j = tl.load(g + row, mask=mj, other=0.0).to(tl.float32)
            below = r[:, None] >= j
            e = tl.where(below, tl.exp(d), 0.0)
            pick = r[None, :] == j
            akk += tl.where(pick, tl.sum(b_k * e * k_j[None, :], 1)[:, None], 0.0)
            aqk += tl.where(pick, tl.sum(b_q * e * k_j[None, :], 1)[:, None], 0.0)
            d_end = tl.sum(tl.where(r[:, None] == BT - 1, d, 0.0), 0)
            kd = tl.where(r[:, None] == j, (k_j * tl.exp(d_end))[None, :], kd)
            d = tl.where(below, d + g_j[None, :], d)
        tl.store(kd_out + base * BT * KP + r[:, None] * KP + cols[None, :], kd)
    tl.store(aqk_out + base * BT * BT + r[:, None] * BT + r[None, :], aqk)
    lmat = tl.where(r[:, None] > r[None, :], akk * b_beta[:, None], 0.0)
    inv = tl.zeros([BT, BT], dtype=tl.float32)  # (I + L)^-1, row by row
    for i in range(BT):
        l_i = tl.sum(tl.where(r[:, None] == i, lmat, 0.0), 0)
        row_i = tl.where(r == i, 1.0, 0.0) - tl.sum(l_i[:, None] * inv, 0)
        inv = tl.where(r[:, None] == i, row_i[None, :], inv)
    m = inv * b_beta[None, :]
    for k0 in tl.static_range(0, KP, BK):
        cols = k0 + tl.arange(0, BK)
        m2 = rm[:, None] & (cols[None, :] < K)
        off = (t0 + r[:, None]) * (H * K) + h * K + cols[None, :]
        b_k = tl.load(k + off, mask=m2, other=0.0).to(tl.float32)
        b_g = tl.load(g + off, mask=m2, other=0.0).to(tl.float32)
        b_w = tl.dot(m, b_k * tl.exp(tl.cumsum(b_g, 0)), input_precision=PREC)
        tl.store(w_out + base * BT * KP + r[:, None] * KP + cols[None, :], b_w)
    for v0 in tl.static_range(0, VP, BV):
        cols = v0 + tl.arange(0, BV)
        b_v = tl.load(v + (t0 + r[:, None]) * (H * V) + h * V + cols[None, :], mask=rm[:, None] & (cols[None, :] < V),
                      other=0.0).to(tl.float32)  # fmt: skip
        tl.store(u_out + base * BT * VP + r[:, None] * VP + cols[None, :], tl.dot(m, b_v, input_precision=PREC))


@triton.jit
def _inter(w_in, u_in, qg_in, kd_in, aqk_in, egc_in, starts, lens, first, count, slot_of, s0, final, saved, out,
           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr,
           BT: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = tl.arange(0, BT)
    kk = tl.arange(0, KP)
    vv = vb * BV + tl.arange(0, BV)
    sm = (kk[:, None] < K) & (vv[None, :] < V)
    s_off = h * K * V + kk[:, None] * V + vv[None, :]
    if HAS_S0:
        s = tl.load(s0 + b.to(tl.int64) * H * K * V + s_off, mask=sm, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([KP, BV], dtype=tl.float32)
    c0 = tl.load(first + b)
    for ci in range(tl.load(count + b)):
        c = (c0 + ci).to(tl.int64)
        base = c * H + h
        kp_off = base * BT * KP + r[:, None] * KP + kk[None, :]
        b_w = tl.load(w_in + kp_off)
        b_qg = tl.load(qg_in + kp_off)
        b_kd = tl.load(kd_in + kp_off)
        b_u = tl.load(u_in + base * BT * VP + r[:, None] * VP + vv[None, :])
        b_a = tl.load(aqk_in + base * BT * BT + r[:, None] * BT + r[None, :])
        b_e = tl.load(egc_in + base * KP + kk)
        delta = b_u - tl.dot(b_w, s, input_precision=PREC)
        o = tl.dot(b_qg, s, input_precision=PREC) + tl.dot(b_a, delta, input_precision=PREC)
        t0 = tl.load(starts + c).to(tl.int64)
        om = (r[:, None] < tl.load(lens + c)) & (vv[None, :] < V)
        tl.store(out + (t0 + r[:, None]) * (H * V) + h * V + vv[None, :], o, mask=om)
        s = b_e[:, None] * s + tl.dot(tl.trans(b_kd), delta, input_precision=PREC)
        slot = tl.load(slot_of + c)
        tl.store(
            saved + tl.maximum(slot, 0).to(tl.int64) * H * K * V + s_off, s, mask=sm & (kk[:, None] * 0 + slot >= 0)
        )
    tl.store(final + b.to(tl.int64) * H * K * V + s_off, s, mask=sm)


@dataclass
class _Plan:
    """`chunk_plan` of one packed batch as the kernels read it (int32 device tensors): chunk starts
    and lengths; per sequence its first chunk and chunk count; per chunk its export slot (-1: none);
    `inverse` maps each requested offset, in order, to its slot."""

    nseq: int
    nc: int = 0
    starts: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    first: torch.Tensor | None = None
    count: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    n_saved: int = 0


_last_plan: list = [None, None]  # [key, _Plan]: every KDA layer of a step plans the same batch


def _plan(cu_seqlens: torch.Tensor, n: int, export_offsets, chunk_size: int, dev: torch.device) -> _Plan:
    """The batch's plan, reused while the same boundaries and offsets come back (keyed on their
    values: every KDA layer of a step plans once, from `cu_seqlens`' host copy)."""
    cu = checked_cu_seqlens(cu_seqlens, n)
    offs = None if export_offsets is None else tuple(tuple(int(o) for o in e) for e in export_offsets)
    key = (tuple(cu.tolist()), offs, chunk_size, dev)
    if _last_plan[0] == key:
        return _last_plan[1]
    plan = _Plan(cu.numel() - 1)
    if n:
        start, length, _, _, n_chunks, ex_chunk = chunk_plan(cu, export_offsets, chunk_size)
        slot = torch.full((start.numel(),), -1, dtype=torch.int32)
        if ex_chunk is not None:
            uniq, inverse = torch.unique(ex_chunk, return_inverse=True)
            slot[uniq] = torch.arange(uniq.numel(), dtype=torch.int32)
            plan.inverse, plan.n_saved = inverse.to(dev, non_blocking=True), uniq.numel()
        i32 = dict(device=dev, dtype=torch.int32, non_blocking=True)
        plan.nc, plan.starts, plan.lens = start.numel(), start.to(**i32), length.to(**i32)
        plan.first, plan.count, plan.slot = excl_cumsum(n_chunks, 0).to(**i32), n_chunks.to(**i32), slot.to(**i32)
    _last_plan[:] = [key, plan]
    return plan


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    export_offsets: list[list[int]] | None = None,
    precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`ops.kda.kda_chunked` on the Triton kernels (same arguments and returns); `precision`:
    the `tl.dot` input precision ("ieee" exact fp32, "tf32" faster on tensor cores)."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    dev = k.device
    f32 = dict(device=dev, dtype=torch.float32)
    plan = _plan(cu_seqlens, n, export_offsets, chunk_size, dev)
    nseq, nc = plan.nseq, plan.nc
    if n == 0:  # no tokens: the state passes through (the plan needs at least one segment)
        final = torch.zeros(nseq, h, dk, dv, **f32) if initial_state is None else initial_state.to(**f32).clone()
        return torch.zeros(0, h, dv, **f32), final, None if export_offsets is None else final.new_empty(0, h, dk, dv)
    starts, lens = plan.starts, plan.lens
    bt, kp, vp = pow2(chunk_size), pow2(dk), pow2(dv)
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    beta = beta.contiguous()
    w_, qg, kd = (torch.empty(nc, h, bt, kp, **f32) for _ in range(3))
    u_, aqk, egc = torch.empty(nc, h, bt, vp, **f32), torch.empty(nc, h, bt, bt, **f32), torch.empty(nc, h, kp, **f32)
    bk, bv = min(kp, 32), min(vp, 32)
    if nc:
        _intra[(nc, h)](q, k, v, g, beta, starts, lens, w_, u_, qg, kd, aqk, egc, float(scale),
                        H=h, K=dk, V=dv, KP=kp, VP=vp, BT=bt, BK=bk, BV=bv, PREC=precision, num_warps=8)  # fmt: skip
    final = torch.empty(nseq, h, dk, dv, **f32)
    saved = torch.empty(plan.n_saved, h, dk, dv, **f32)
    out = torch.empty(n, h, dv, **f32)
    s0 = None if initial_state is None else initial_state.to(**f32).contiguous()
    bv = min(vp, 32)
    if nseq:
        _inter[(nseq, h, triton.cdiv(dv, bv))](
            w_, u_, qg, kd, aqk, egc, starts, lens, plan.first, plan.count, plan.slot,
            final if s0 is None else s0, final, saved, out,
            H=h, K=dk, V=dv, KP=kp, VP=vp, BT=bt, BV=bv, HAS_S0=s0 is not None, PREC=precision, num_warps=8,
        )  # fmt: skip
    return out, final, None if plan.inverse is None else saved[plan.inverse]


@triton.jit
def _conv_step(x, tails, slots, weight, y, C: tl.constexpr, W: tl.constexpr, BC: tl.constexpr):
    """One token per sequence: y = silu(conv(tail ++ x)); the slot's tail shifts in place."""
    b, cb = tl.program_id(0), tl.program_id(1)
    cols = cb * BC + tl.arange(0, BC)
    cm = cols < C
    t = tails + tl.load(slots + b).to(tl.int64) * (W - 1) * C + cols
    xv = tl.load(x + b.to(tl.int64) * C + cols, mask=cm, other=0.0).to(tails.dtype.element_ty)
    acc = tl.load(weight + cols * W + W - 1, mask=cm, other=0.0).to(tl.float32) * xv.to(tl.float32)
    for j in tl.static_range(W - 1):
        row = tl.load(t + j * C, mask=cm, other=0.0)
        acc += tl.load(weight + cols * W + j, mask=cm, other=0.0).to(tl.float32) * row.to(tl.float32)
        if j > 0:
            tl.store(t + (j - 1) * C, row, mask=cm)
    if W > 1:
        tl.store(t + (W - 2) * C, xv, mask=cm)
    tl.store(y + b.to(tl.int64) * C + cols, acc * tl.sigmoid(acc), mask=cm)


@triton.jit
def _recurrent_step(mixed, f, a_log, dt_bias, beta, states, slots, out, scale, lower_bound,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
                    L2: tl.constexpr, GATE: tl.constexpr):  # fmt: skip
    """One token per sequence and head over a value block: (optionally) L2-normalise q and k and
    form the gate, then S <- diag(exp(g)) S; S += beta k (v - S^T k)^T; o = scale S^T q, with S
    read from and written back to `states[slots[b], h]`."""
    bh, vb = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kk = tl.arange(0, KP)
    vv = vb * BV + tl.arange(0, BV)
    km, vm = kk < K, vv < V
    row = mixed + b.to(tl.int64) * (2 * H * K + H * V)
    q = tl.load(row + h * K + kk, mask=km, other=0.0).to(tl.float32)
    k = tl.load(row + H * K + h * K + kk, mask=km, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * H * K + h * V + vv, mask=vm, other=0.0).to(tl.float32)
    if L2:
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    g = tl.load(f + b.to(tl.int64) * H * K + h * K + kk, mask=km, other=0.0).to(tl.float32)
    if GATE != 0:
        x = g + tl.load(dt_bias + h * K + kk, mask=km, other=0.0).to(tl.float32)
        a = tl.exp(tl.load(a_log + h).to(tl.float32))
        if GATE == 1:
            g = lower_bound * tl.sigmoid(a * x)
        else:
            g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    sp = states + (tl.load(slots + b).to(tl.int64) * H + h) * K * V + kk[:, None] * V + vv[None, :]
    sm = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32) * tl.exp(g)[:, None]
    delta = tl.load(beta + b * H + h).to(tl.float32) * (v - tl.sum(k[:, None] * s, 0))
    s += k[:, None] * delta[None, :]
    tl.store(sp, s, mask=sm)
    tl.store(out + (b.to(tl.int64) * H + h) * V + vv, scale * tl.sum(q[:, None] * s, 0), mask=vm)


def conv_step(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`ops.kda.causal_conv1d_step` over a slot pool: x [B, C], weight [C, W], tails [S, W-1, C]
    (contiguous; the rows of `slots` [B] shift in place). Returns y fp32 [B, C]."""
    b, c = x.shape
    y = torch.empty(b, c, device=x.device, dtype=torch.float32)
    if b:
        bc = min(triton.next_power_of_2(c), 1024)
        _conv_step[(b, triton.cdiv(c, bc))](
            x.contiguous(), tails, slots, weight.contiguous(), y, C=c, W=weight.shape[-1], BC=bc
        )
    return y


def recurrent_step(
    mixed: torch.Tensor,
    f: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    heads: int,
    gate: int = GATE_GIVEN,
    a_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = 0.0,
    l2: bool = True,
) -> torch.Tensor:
    """`ops.kda.kda_recurrent_step` over a slot pool, updating `states[slots]` IN PLACE.
    mixed: [B, 2HK + HV] post-conv q|k|v (L2-normalised here when `l2`); f: [B, H*K] the log
    decay g (`GATE_GIVEN`) or the gate input of `kda_gate_sigmoid` / `kda_gate_softplus`;
    beta: [B, H] post-sigmoid; states: contiguous fp32 [S, H, K, V]. Returns o fp32 [B, H, V]."""
    b = mixed.shape[0]
    _, h, dk, dv = states.shape
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("recurrent_step needs a contiguous fp32 state pool")
    out = torch.empty(b, h, dv, device=mixed.device, dtype=torch.float32)
    if b:
        kp = pow2(dk, 1)
        bv = min(pow2(dv, 1), 32)
        dummy = beta
        _recurrent_step[(b * h, triton.cdiv(dv, bv))](
            mixed.contiguous(), f.contiguous(), dummy if a_log is None else a_log.contiguous(),
            dummy if dt_bias is None else dt_bias.contiguous(), beta.contiguous(), states, slots, out,
            float(scale), float(lower_bound), H=h, K=dk, V=dv, KP=kp, BV=bv, L2=l2, GATE=gate,
        )  # fmt: skip
    return out
