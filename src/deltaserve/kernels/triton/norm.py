"""Triton Block AttnRes mix and RMSNorm, fused: one program per row.

`mix_norm(sources, q, ...)` computes `ops.attn_res.attn_res_mix` over `sources` (the bank, then
cur) with `q = norm * proj`, then `ops.norms.rms_norm` of the mix when a weight is given; with one
source and no `q` it is the plain RMSNorm. Rounding follows the reference: scores, softmax and the
mix in fp32, the mix cast to the output dtype, renormalised in fp32 and cast back before the weight
multiply. The softmax over depth runs online (each source row is read once); only the summation
order differs from the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix_norm_kernel(
    srcs,
    q,
    w,
    out,
    stride_src,
    stride_out,
    D,
    eps_mix,
    eps_norm,
    S: tl.constexpr,
    MIX: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    if MIX:
        qv = tl.load(q + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in tl.static_range(S):
            x = tl.load(srcs[s] + row * stride_src + offs, mask=mask, other=0.0).to(tl.float32)
            score = tl.sum(x * qv, 0) * tl.rsqrt(tl.sum(x * x, 0) / D + eps_mix)
            m_new = tl.maximum(m, score)
            alpha = tl.exp(m - m_new)
            p = tl.exp(score - m_new)
            acc = acc * alpha + p * x
            total = total * alpha + p
            m = m_new
        mixed = (acc / total).to(out.dtype.element_ty)
    else:
        mixed = tl.load(srcs[0] + row * stride_src + offs, mask=mask, other=0.0).to(out.dtype.element_ty)
    if NORM:
        xf = mixed.to(tl.float32)
        y = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / D + eps_norm)).to(out.dtype.element_ty)
        wv = tl.load(w + offs, mask=mask, other=0.0).to(tl.float32)
        mixed = (wv * y.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + row * stride_out + offs, mixed, mask=mask)


def mix_norm(
    sources: list[torch.Tensor],
    q: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps_mix: float,
    eps_norm: float,
) -> torch.Tensor:
    """Sources: tensors of one shape [..., D] and dtype (the last one's dtype is the output's);
    q [D] fp32 (None: no mix, exactly one source); weight [D] (None: no norm). Returns [..., D]."""
    last = sources[-1]
    d = last.shape[-1]
    rows = [s.reshape(-1, d).contiguous() for s in sources]
    n = rows[0].shape[0]
    out = torch.empty(n, d, dtype=last.dtype, device=last.device)
    if n:
        block = triton.next_power_of_2(d)
        _mix_norm_kernel[(n,)](
            tuple(rows),
            q if q is not None else rows[0],
            weight.contiguous() if weight is not None else rows[0],
            out,
            d,
            d,
            d,
            eps_mix,
            eps_norm,
            S=len(rows),
            MIX=q is not None,
            NORM=weight is not None,
            BLOCK_D=block,
            num_warps=min(16, max(1, block // 512)),
        )
    return out.view(last.shape)
