"""Launch helpers every Triton kernel wrapper shares: block widths and the `tl.dot` precision."""

from __future__ import annotations

import torch
import triton


def pow2(n: int, least: int = 16) -> int:
    """The block width covering n: the next power of two, at least `least` (`tl.dot` wants 16)."""
    return max(least, triton.next_power_of_2(max(n, 1)))


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot`'s input precision for operands of `dtype`: exact fp32 ("ieee") for fp32, the
    default (TF32 / native half precision on tensor cores) otherwise."""
    return "ieee" if dtype == torch.float32 else None
