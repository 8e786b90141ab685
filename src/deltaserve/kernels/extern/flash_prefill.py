"""torch's FlashAttention varlen kernel (`torch.nn.attention.varlen.varlen_attn`) for MLA prefill.

Used where it fits: CUDA tensors in bf16/fp16, head widths <= 256, a torch that has the function,
and not disabled with `DELTASERVE_TORCH_FLASH=0`; `mla_prefill.mla_prefill_attention` (ours)
everywhere else. The kernel wants one key tensor and equal q/k/v widths, so the shared rope part
is broadcast into the keys and v is zero-padded to the q/k width (the extra output columns are
dropped). Causal within each packed sequence (`window_size=(-1, 0)`); the longest sequence comes
from `cu_seqlens`' host copy (no device read).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ... import env
from ...kernels.transfer import host_copy
from ...ops.mla import joined_keys
from ..triton import optional_import

_MAX_WIDTH = 256


@functools.cache
def _varlen_attn():
    return optional_import("torch.nn.attention.varlen", "varlen_attn", env.TORCH_FLASH)


def available() -> bool:
    return _varlen_attn() is not None


def fits(q: torch.Tensor, v_dim: int) -> bool:
    """Whether the flash kernel runs this prefill: CUDA, half precision, widths it supports."""
    width = max(q.shape[-1], v_dim)
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and width <= _MAX_WIDTH and available()


def prefill(q, k_nope, k_rot, v, cu_seqlens, scale) -> torch.Tensor:
    """`TorchOps.mla_prefill` on the flash kernel: [N, H, Dv] in q's dtype."""
    dv, width = v.shape[-1], max(q.shape[-1], v.shape[-1])
    k = joined_keys(k_nope, k_rot)
    q, k, v = (F.pad(t.to(q.dtype), (0, width - t.shape[-1])).contiguous() for t in (q, k, v))
    lens = host_copy(cu_seqlens).diff()
    longest = int(lens.max()) if lens.numel() else 0
    cu = cu_seqlens.to(torch.int32)
    o = _varlen_attn()(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))
    return o[..., :dv]
