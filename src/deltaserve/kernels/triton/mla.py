"""Triton paged absorbed MLA decode (`ops.mla.mla_absorbed_attention` for one query per sequence).

Query b (q_latent [B, H, R + Dr] = [W_UK^T q_nope | q_rot]) attends all rows of its context: the
pool rows [num_rows, R + Dr] at `read_rows[cu_kv[b]:cu_kv[b+1]]` (the flat form of the page table),
or, given a block table [B, max_pages], position t at row `table[b, t // page] * page + t % page`.
Keys are the full rows (latent and rope parts), values the first R columns; rows are cast to the
query dtype, scores, softmax and accumulation run in fp32.

The context axis is split into `splits` equal chunks (flash decoding, grid = B x head blocks x
splits, no host sync: the chunk length comes from the total row count); each split returns its
normalised output and log-sum-exp, merged by `ops.mla.lse_combine`. An empty split gives o = 0,
lse = -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.mla import lse_combine
from .sizes import dot_precision, pow2


@triton.jit
def softmax_step(s, m, total):
    """One key block of an online softmax: scores s [M, N] (masked entries -inf), running max m and
    denominator total [M] -> (p = exp(s - new max), alpha = the factor for what was accumulated,
    new max, new denominator). Rows must have seen a finite score by their first block."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return p, alpha, m_new, total * alpha + tl.sum(p, 1)


@triton.jit
def _mla_decode_kernel(
    q,
    rows,
    read_rows,
    table,
    cu_kv,
    o,
    lse,
    stride_qb,
    stride_qh,
    stride_row,
    stride_tb,
    stride_os,
    stride_ob,
    stride_oh,
    stride_ls,
    stride_lb,
    H,
    R,
    DR,
    chunk,
    scale,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    start = tl.load(cu_kv + b)
    length = tl.load(cu_kv + b + 1) - start
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    offs_p = tl.arange(0, BLOCK_DR)
    pmask = offs_p < DR
    q_base = q + b * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    if HAS_PE:
        q_pe = tl.load(q_base + R + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < hi
        if PAGED:
            page = tl.load(table + b * stride_tb + pos // PAGE, mask=nmask, other=0)
            row = page.to(tl.int64) * PAGE + pos % PAGE
        else:
            row = tl.load(read_rows + start + pos, mask=nmask, other=0).to(tl.int64)
        row_base = rows + row[:, None] * stride_row
        kv = tl.load(row_base + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)
        kv = kv.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(kv), input_precision=PRECISION)
        if HAS_PE:
            kpe = tl.load(row_base + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0)
            s = tl.dot(q_pe, tl.trans(kpe.to(q_pe.dtype)), s, input_precision=PRECISION)
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        p, alpha, m, total = softmax_step(s, m, total)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=PRECISION)
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    o_ptr = o + split * stride_os + b * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :]
    tl.store(o_ptr, out, mask=hmask[:, None] & rmask[None, :])
    lse_val = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(lse + split * stride_ls + b * stride_lb + offs_h, lse_val, mask=hmask)


def _splits(batch: int, head_blocks: int, total_rows: int, block_n: int, target: int) -> int:
    """Context splits so that the grid has about `target` programs, each with >= 4 key blocks."""
    want = max(1, target // max(1, batch * head_blocks))
    return max(1, min(want, total_rows // (4 * block_n)))


def mla_decode_attention(
    q_latent: torch.Tensor,
    rows: torch.Tensor,
    cu_kv: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    read_rows: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    page_size: int = 0,
    splits: int | None = None,
) -> torch.Tensor:
    """Latent outputs [B, H, R] in q_latent's dtype of one query per sequence over its whole
    context (`read_rows`, or `block_table` with `page_size`: see the module docstring)."""
    b, h, dk = q_latent.shape
    r, dr = kv_lora_rank, dk - kv_lora_rank
    paged = block_table is not None
    if paged:
        total = block_table.shape[1] * page_size
        table = block_table.contiguous()
        read_rows = table
    else:
        total = read_rows.shape[0]
        table = read_rows
    block_h = 16
    block_r = pow2(r)
    block_n = 32 if q_latent.is_cuda else 16
    head_blocks = triton.cdiv(h, block_h)
    if splits is None:
        splits = _splits(b, head_blocks, total, block_n, 264 if q_latent.is_cuda else 1)
    chunk = triton.cdiv(max(total, 1), splits)
    o = torch.empty(splits, b, h, r, dtype=torch.float32, device=q_latent.device)
    lse = torch.empty(splits, b, h, dtype=torch.float32, device=q_latent.device)
    if b:
        q = q_latent.contiguous()
        _mla_decode_kernel[(b, head_blocks, splits)](
            q,
            rows,
            read_rows,
            table,
            cu_kv.contiguous(),
            o,
            lse,
            q.stride(0),
            q.stride(1),
            rows.stride(0),
            table.stride(0),
            o.stride(0),
            o.stride(1),
            o.stride(2),
            lse.stride(0),
            lse.stride(1),
            h,
            r,
            dr,
            chunk,
            float(scale),
            PAGED=paged,
            PAGE=max(page_size, 1),
            HAS_PE=dr > 0,
            BLOCK_H=block_h,
            BLOCK_R=block_r,
            BLOCK_DR=pow2(dr),
            BLOCK_N=block_n,
            PRECISION=dot_precision(q.dtype),
            num_warps=8 if block_r >= 256 else 4,
        )
    out = o[0] if splits == 1 else lse_combine(o, lse)[0]
    return out.to(q_latent.dtype)
