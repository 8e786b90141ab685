"""Linear layers with a small-M native path: `y = x @ w.T` (bias-free, as in this family).

Decode steps multiply a handful of rows by each weight: a GEMV, where torch's bf16 `F.linear`
streams weights well below memory bandwidth. For bf16 operands with at most
`kernels.cpu.MAX_ROWS` rows the native GEMV kernel runs instead, and up to AMX_ROWS rows the AMX
tile kernel where the CPU has one (batched decode: oneDNN reorders the weight on every such call);
everything else (and every tensor when the kernels are unavailable) goes through `F.linear`, the
reference. All accumulate in fp32 and round once to bf16; only the summation order differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cpu import MAX_ROWS, native


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` for x [..., K] and w [N, K]."""
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.is_cpu and w.is_contiguous():
        k = x.shape[-1]
        rows = x.shape[0] if x.dim() == 2 else (x.numel() // k if k else 0)
        kernels = native() if rows > 0 else None
        if kernels is not None and rows <= kernels.multi_rows(k):
            flat = x if x.dim() == 2 else x.reshape(rows, k)
            y = kernels.linear_bf16(flat, w) if rows <= MAX_ROWS else kernels.linear_bf16_multi(flat, [w])[0]
            return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)
