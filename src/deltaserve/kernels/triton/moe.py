"""Triton routed experts (`ops.moe.grouped_experts`): grouped GEMMs over the (token, slot) pairs
sorted by expert, with MXFP4 weights decoded in the loads.

The N * k pairs are sorted by expert (stable); each expert's rows are cut into BLOCK_M blocks. The
block schedule (expert, first row, end row per block) is built on the device with no host sync:
the grid is an upper bound on the block count and surplus programs return at once.
  1. gate/up: h = act(x.dtype(x W1_e^T), x.dtype(x W3_e^T)) in sorted order, [N * k, I];
  2. down: y = x.dtype(h W2_e^T), stored at the pair's own row (token * k + slot);
  3. combine: out[n] = x.dtype(sum over slots j in order of fp32 w[n, j] * y[n, j]).
Weights are `[E, O, I]` dense tensors or MXFP4 `(packed [E, O, I/2], scale [E, O, I/32])` pairs
(e2m1 low nibble first, e8m0 scales, validated at load by `mxfp4_validate`, not here), decoded
exactly in fp32, then cast to x's dtype. Products accumulate in fp32; x is fp32 or bf16. `act`:
SiTU (beta, linear_beta or None) or SwiGLU, each rounded as `ops.activations` rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sizes import dot_precision

ACT_SITU, ACT_SILU = 0, 1


@triton.jit
def _tanh(x):
    """tanh to a few fp32 ulp: Cephes' tanhf polynomial below |x| = 0.625, 1 - 2 / (e^2|x| + 1) above."""
    a = tl.abs(x)
    z = x * x
    poly = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
            - 3.33332819422e-1) * z * x + x  # fmt: skip
    big = 1.0 - 2.0 / (tl.exp(2.0 * tl.minimum(a, 20.0)) + 1.0)
    return tl.where(a < 0.625, poly, tl.where(x < 0, -big, big))


@triton.jit
def situ(g, u, beta, linear_beta, HAS_LIN: tl.constexpr):
    """SiTU of the fp32 gate and up values (already rounded to the activation dtype), in fp32."""
    right = u
    if HAS_LIN:
        right = linear_beta * _tanh(u / linear_beta)
    return beta * _tanh(g / beta) * tl.sigmoid(g) * right


@triton.jit
def _weight_tile(w, s, e, offs_o, offs_i, n_out, n_in, ws, ss, PACKED: tl.constexpr):
    """The fp32 tile W_e[o, i] as [len(offs_i), len(offs_o)] (transposed for x @ W^T); ws, ss: the
    (expert, row, column) strides of the weights (bytes of two codes when packed) and scales."""
    mask = (offs_i[:, None] < n_in) & (offs_o[None, :] < n_out)
    if PACKED:
        byte = tl.load(w + e * ws[0] + offs_o[None, :] * ws[1] + (offs_i[:, None] // 2) * ws[2], mask=mask, other=0)
        nib = (byte.to(tl.int32) >> ((offs_i[:, None] % 2) * 4)) & 0xF
        sb = tl.load(s + e * ss[0] + offs_o[None, :] * ss[1] + (offs_i[:, None] // 32) * ss[2], mask=mask, other=127)
        sb = sb.to(tl.int32)
        code = nib & 7
        ex = code >> 1
        man = (code & 1).to(tl.float32)
        pow2 = tl.where(ex == 3, 4.0, tl.where(ex == 2, 2.0, 1.0))
        mag = tl.where(ex == 0, 0.5 * man, (1.0 + 0.5 * man) * pow2)
        scale = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)
        return tl.where(nib >= 8, -mag, mag) * scale
    tile = tl.load(w + e * ws[0] + offs_o[None, :] * ws[1] + offs_i[:, None] * ws[2], mask=mask, other=0.0)
    return tile.to(tl.float32)


@triton.jit
def _block_rows(block_expert, block_row, block_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert (E or more: a padding block), its rows of the sorted pairs with their
    mask, and its output columns."""
    pid = tl.program_id(0)
    e = tl.load(block_expert + pid).to(tl.int64)
    rows = tl.load(block_row + pid) + tl.arange(0, BLOCK_M)
    rmask = rows < tl.load(block_end + pid)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, rows, rmask, offs_n


@triton.jit
def _gate_up_kernel(
    x,
    tokens,
    block_expert,
    block_row,
    block_end,
    w1,
    s1,
    w3,
    s3,
    h,
    E,
    D,
    INTER,
    stride_x,
    ws1,
    ss1,
    ws3,
    ss3,
    beta,
    linear_beta,
    ACT: tl.constexpr,
    HAS_LIN: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    e, rows, rmask, offs_n = _block_rows(block_expert, block_row, block_end, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    tok = tl.load(tokens + rows, mask=rmask, other=0)
    xdt = x.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xmask = rmask[:, None] & (offs_k[None, :] < D)
        xt = tl.load(x + tok[:, None] * stride_x + offs_k[None, :], mask=xmask, other=0.0)
        wg = _weight_tile(w1, s1, e, offs_n, offs_k, INTER, D, ws1, ss1, PACKED)
        wu = _weight_tile(w3, s3, e, offs_n, offs_k, INTER, D, ws3, ss3, PACKED)
        acc_g = tl.dot(xt, wg.to(xdt), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(xt, wu.to(xdt), acc_u, input_precision=PRECISION)
    g = acc_g.to(xdt).to(tl.float32)
    u = acc_u.to(xdt).to(tl.float32)
    if ACT == 0:
        out = situ(g, u, beta, linear_beta, HAS_LIN).to(xdt)
    else:
        out = ((g * tl.sigmoid(g)).to(xdt).to(tl.float32) * u).to(xdt)
    tl.store(h + rows[:, None] * INTER + offs_n[None, :], out, mask=rmask[:, None] & (offs_n[None, :] < INTER))


@triton.jit
def _down_kernel(
    h,
    pairs,
    block_expert,
    block_row,
    block_end,
    w2,
    s2,
    y,
    E,
    INTER,
    DOUT,
    ws2,
    ss2,
    PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    e, rows, rmask, offs_n = _block_rows(block_expert, block_row, block_end, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        hmask = rmask[:, None] & (offs_k[None, :] < INTER)
        ht = tl.load(h + rows[:, None] * INTER + offs_k[None, :], mask=hmask, other=0.0)
        wd = _weight_tile(w2, s2, e, offs_n, offs_k, DOUT, INTER, ws2, ss2, PACKED)
        acc = tl.dot(ht, wd.to(ht.dtype), acc, input_precision=PRECISION)
    dst = tl.load(pairs + rows, mask=rmask, other=0)
    tl.store(
        y + dst[:, None] * DOUT + offs_n[None, :],
        acc.to(y.dtype.element_ty),
        mask=rmask[:, None] & (offs_n[None, :] < DOUT),
    )


@triton.jit
def _combine_kernel(y, w, out, D, K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.load(w + n * K) * tl.load(y + n * K * D + offs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, K):
        acc += tl.load(w + n * K + j) * tl.load(y + (n * K + j) * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + n * D + offs, acc.to(out.dtype.element_ty), mask=mask)


def _schedule(flat: torch.Tensor, num_experts: int, block_m: int):
    """(pairs sorted by expert, per block: expert (E past the last), first sorted row, end row),
    all computed on the device: the grid is sized from host numbers alone."""
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would read its max back to the host
    ends = torch.cumsum(counts, 0)
    blocks = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks, 0)
    bound = triton.cdiv(flat.numel(), block_m) + min(num_experts, flat.numel())
    pid = torch.arange(bound, device=flat.device)
    expert = torch.searchsorted(block_ends, pid, right=True)
    safe = expert.clamp(max=num_experts - 1)
    first = ends[safe] - counts[safe] + (pid - block_ends[safe] + blocks[safe]) * block_m
    return order, expert, first, ends[safe]


def _operand(w):
    """(weights, scales or weights, weight strides, scale strides) of a dense or packed operand."""
    if isinstance(w, tuple):
        return w[0], w[1], w[0].stride(), w[1].stride()
    return w, w, w.stride(), w.stride()


def grouped_experts(x, ids, weights, w1, w3, w2, act: int, beta: float = 0.0, linear_beta: float | None = None):
    """`ops.moe.grouped_experts` for x [N, Din] fp32/bf16, ids/weights [N, k]; w1/w3 describe
    [E, I, Din], w2 [E, Dout, I] (dense, or packed pairs, all three alike)."""
    n, k = ids.shape
    packed = isinstance(w1, tuple)
    num_experts, inter = w1[0].shape[:2] if packed else w1.shape[:2]
    d_out = w2[0].shape[1] if packed else w2.shape[1]
    out = torch.empty(n, d_out, dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return out.zero_()
    cuda = x.is_cuda
    # prefill-sized batches (>= 32 pairs per expert on average) reuse each weight tile over more rows
    block_m = 64 if cuda and n * k >= 32 * num_experts else 16
    block_n, block_k = (64, 64) if cuda else (16, 32)
    precision = dot_precision(x.dtype)
    order, expert, first, end = _schedule(ids.reshape(-1), num_experts, block_m)
    x = x.contiguous()
    h = torch.empty(n * k, inter, dtype=x.dtype, device=x.device)
    a, sa, wsa, ssa = _operand(w1)
    b, sb, wsb, ssb = _operand(w3)
    grid = (expert.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](
        x, order // k, expert, first, end, a, sa, b, sb, h, num_experts, x.shape[1], inter, x.stride(0),
        wsa, ssa, wsb, ssb, float(beta), float(linear_beta or 1.0),
        ACT=act, HAS_LIN=linear_beta is not None, PACKED=packed,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
    )  # fmt: skip
    y = torch.empty(n * k, d_out, dtype=x.dtype, device=x.device)
    c, sc, wsc, ssc = _operand(w2)
    grid = (expert.numel(), triton.cdiv(d_out, block_n))
    _down_kernel[grid](
        h, order, expert, first, end, c, sc, y, num_experts, inter, d_out, wsc, ssc,
        PACKED=packed, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
    )  # fmt: skip
    block_d = min(1024, triton.next_power_of_2(d_out))
    _combine_kernel[(n, triton.cdiv(d_out, block_d))](y, weights.float().contiguous(), out, d_out, K=k, BLOCK_D=block_d)
    return out
