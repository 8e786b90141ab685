"""Linear layers with a small-M native path: `y = x @ w.T` (bias-free, as in this family).

Decode steps multiply a handful of rows by each weight: a GEMV, where torch's bf16 `F.linear`
streams weights well below memory bandwidth. For bf16 operands with at most
`cpu_kernels.MAX_ROWS` rows the native kernel runs instead; everything else (and every
tensor when the kernels are unavailable) goes through `F.linear`, the reference. Both
accumulate in fp32 and round once to bf16; only the summation order differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_kernels import MAX_ROWS, native


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` for x [..., K] and w [N, K]."""
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu":
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 0 < rows <= MAX_ROWS and w.is_contiguous():
            kernels = native()
            if kernels is not None:
                y = kernels.linear_bf16(x.reshape(rows, x.shape[-1]), w)
                return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)
