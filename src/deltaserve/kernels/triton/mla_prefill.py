"""Triton MLA attention for steps with many queries per sequence (`ops.mla` on kernels).

`mla_prefill_attention`: causal attention within each packed sequence in the unabsorbed form
(fresh prompts), reading k as its two parts in place: `k_nope` [N, H, Dn] per head and `k_rot`
[N, Dr] shared by every head (no [N, H, Dn + Dr] key tensor is built), q [N, H, Dn + Dr] and
v [N, H, Dv]. Query i of a sequence sees its keys 0..i.

`mla_extend_attention`: absorbed attention of the step's queries over each sequence's whole
context in the pool, through its block table (prefill over a cached prefix, mixed batches): query
i of sequence b (n_b queries, c_b context rows including the step's own) sits at position
c_b - n_b + i and sees positions 0..c_b - n_b + i. Keys are the full rows [R + Dr], values their
first R columns. A program takes BLOCK_Q queries x BLOCK_H heads of one sequence as the rows of
its tiles, so each key block is loaded once for all of them.

Both plan their tiles (sequence, first query) on the host from the host copies of the boundaries
(`kernels.transfer.host_copy`: no device read), run scores, softmax and accumulation in fp32, and
return q's dtype. Every valid query sees key 0, so the online softmax never meets an all-masked
first block; rows past a sequence's end compute finite garbage and are not stored.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ...kernels.transfer import host_copy, to_device
from .mla import softmax_step
from .sizes import dot_precision, pow2

_NEVER: tl.constexpr = tl.constexpr(1 << 62)  # a padded query row's position: sees every key, not stored


@triton.jit
def _prefill_kernel(
    q, k_nope, k_rot, v, o, cu, tile_seq, tile_q0,
    sq_n, sq_h, skn_n, skn_h, skr_n, sv_n, sv_h, so_n, so_h,
    DN, DR, DV, scale,
    HAS_ROT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr,
    BLOCK_DR: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(tile_seq + t)
    q0 = tl.load(tile_q0 + t)
    start = tl.load(cu + b)
    n = tl.load(cu + b + 1) - start
    qi = q0 + tl.arange(0, BLOCK_M)
    qmask = qi < n
    qpos = tl.where(qmask, qi, _NEVER)
    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    q_row = q + (start + qi[:, None]).to(tl.int64) * sq_n + h * sq_h
    qn = tl.load(q_row + dn[None, :], mask=qmask[:, None] & (dn[None, :] < DN), other=0.0)
    if HAS_ROT:
        qr = tl.load(q_row + DN + dr[None, :], mask=qmask[:, None] & (dr[None, :] < DR), other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = tl.minimum(n, q0 + BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        kj = n0 + tl.arange(0, BLOCK_N)
        kmask = kj < hi
        key = (start + kj[:, None]).to(tl.int64)
        kn = tl.load(
            k_nope + key * skn_n + h * skn_h + dn[None, :], mask=kmask[:, None] & (dn[None, :] < DN), other=0.0
        )
        s = tl.dot(qn, tl.trans(kn.to(qn.dtype)), input_precision=PRECISION)
        if HAS_ROT:
            kr = tl.load(k_rot + key * skr_n + dr[None, :], mask=kmask[:, None] & (dr[None, :] < DR), other=0.0)
            s = tl.dot(qr, tl.trans(kr.to(qr.dtype)), s, input_precision=PRECISION)
        s = tl.where(kmask[None, :] & (kj[None, :] <= qpos[:, None]), s * scale, float("-inf"))
        p, alpha, m, total = softmax_step(s, m, total)
        vv = tl.load(v + key * sv_n + h * sv_h + dv[None, :], mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
        acc = tl.dot(p.to(qn.dtype), vv.to(qn.dtype), acc * alpha[:, None], input_precision=PRECISION)
    out = acc / total[:, None]
    o_ptr = o + (start + qi[:, None]).to(tl.int64) * so_n + h * so_h + dv[None, :]
    tl.store(o_ptr, out, mask=qmask[:, None] & (dv[None, :] < DV))


@triton.jit
def _extend_kernel(
    q, rows, table, cu_q, cu_kv, o, tile_seq, tile_q0,
    sq_n, sq_h, s_row, s_tb, so_n, so_h,
    H, R, DR, scale,
    PAGE: tl.constexpr, HAS_PE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    b = tl.load(tile_seq + t).to(tl.int64)
    q0 = tl.load(tile_q0 + t)
    q_start = tl.load(cu_q + b)
    n = tl.load(cu_q + b + 1) - q_start
    c = tl.load(cu_kv + b + 1) - tl.load(cu_kv + b)
    mrow = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = q0 + mrow // BLOCK_H
    hh = tl.program_id(1) * BLOCK_H + mrow % BLOCK_H
    valid = (qi < n) & (hh < H)
    qpos = tl.where(valid, c - n + qi, _NEVER)
    offs_r, offs_p = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_DR)
    rmask, pmask = offs_r < R, offs_p < DR
    q_row = q + (q_start + qi[:, None]).to(tl.int64) * sq_n + hh[:, None].to(tl.int64) * sq_h
    q_lat = tl.load(q_row + offs_r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
    if HAS_PE:
        q_pe = tl.load(q_row + R + offs_p[None, :], mask=valid[:, None] & pmask[None, :], other=0.0)
    m = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_R], tl.float32)
    hi = tl.minimum(c, c - n + q0 + BLOCK_Q)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < hi
        page = tl.load(table + b * s_tb + pos // PAGE, mask=nmask, other=0)
        row_base = rows + (page.to(tl.int64) * PAGE + pos % PAGE)[:, None] * s_row
        kv = tl.load(row_base + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(kv), input_precision=PRECISION)
        if HAS_PE:
            kpe = tl.load(row_base + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0)
            s = tl.dot(q_pe, tl.trans(kpe.to(q_pe.dtype)), s, input_precision=PRECISION)
        s = tl.where(nmask[None, :] & (pos[None, :] <= qpos[:, None]), s * scale, float("-inf"))
        p, alpha, m, total = softmax_step(s, m, total)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision=PRECISION)
    out = acc / total[:, None]
    o_ptr = o + (q_start + qi[:, None]).to(tl.int64) * so_n + hh[:, None].to(tl.int64) * so_h + offs_r[None, :]
    tl.store(o_ptr, out, mask=valid[:, None] & rmask[None, :])


_last_tiles: list = [None, None]  # ((host boundaries, block, device), tiles): a step's MLA layers plan once


def _tiles(cu_q: torch.Tensor, block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query) of each tile of `block` queries, planned from cu_q's host copy; reused
    while the same host tensor comes back (a step's boundaries are never written in place)."""
    host = host_copy(cu_q)
    key = _last_tiles[0]
    if key is not None and key[0] is host and key[1:] == (block, device):
        return _last_tiles[1]
    cu = host.numpy().astype(np.int64)
    counts = -(-np.diff(cu) // block)
    seq = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    q0 = (np.arange(seq.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * block
    plan = to_device({"seq": torch.from_numpy(seq), "q0": torch.from_numpy(q0)}, device)
    _last_tiles[:] = [(host, block, device), (plan["seq"], plan["q0"])]
    return _last_tiles[1]


def mla_prefill_attention(
    q: torch.Tensor, k_nope: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention per packed sequence, [N, H, Dv] in q's dtype (module docstring). k_nope,
    k_rot and v may be strided views (last dim contiguous): the layer's slices of its projections."""
    n, h, _ = q.shape
    dn, dr, dv = k_nope.shape[-1], k_rot.shape[-1], v.shape[-1]
    out = q.new_empty(n, h, dv)
    if n == 0:
        return out
    block_m = 64 if q.is_cuda else 16
    seq, q0 = _tiles(cu_seqlens, block_m, q.device)
    q = q.contiguous()
    _prefill_kernel[(seq.numel(), h)](
        q, k_nope, k_rot, v, out, cu_seqlens, seq, q0,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_rot.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), dn, dr, dv, float(scale),
        HAS_ROT=dr > 0, BLOCK_M=block_m, BLOCK_N=32 if q.is_cuda else 16, BLOCK_DN=pow2(dn),
        BLOCK_DR=pow2(dr), BLOCK_DV=pow2(dv), PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


def mla_extend_attention(
    q_latent: torch.Tensor,
    rows: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Latent outputs [Nq, H, R] in q_latent's dtype of the step's queries over their contexts in
    the pool (module docstring); rows [num_rows, R + Dr] with a contiguous last dim."""
    nq, h, dk = q_latent.shape
    r, dr = kv_lora_rank, dk - kv_lora_rank
    out = q_latent.new_empty(nq, h, r)
    if nq == 0:
        return out
    block_h = min(16, pow2(h))
    block_q = max(1, (64 if q_latent.is_cuda else 32) // block_h)
    seq, q0 = _tiles(cu_q, block_q, q_latent.device)
    q, table = q_latent.contiguous(), block_table.contiguous()
    block_r = pow2(r)
    _extend_kernel[(seq.numel(), triton.cdiv(h, block_h))](
        q, rows, table, cu_q, cu_kv, out, seq, q0,
        q.stride(0), q.stride(1), rows.stride(0), table.stride(0), out.stride(0), out.stride(1),
        h, r, dr, float(scale),
        PAGE=page_size, HAS_PE=dr > 0, BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=32 if q.is_cuda else 16,
        BLOCK_R=block_r, BLOCK_DR=pow2(dr), PRECISION=dot_precision(q.dtype), num_warps=8 if block_r >= 256 else 4,
    )  # fmt: skip
    return out
