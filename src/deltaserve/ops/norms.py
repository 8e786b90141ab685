"""RMSNorm variants (spec/model.md §3). Each use site passes its own eps."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm: `weight * cast_to_x_dtype(x_f32 * rsqrt(mean(x_f32^2) + eps))`.
    The normalised value is cast back to x's dtype BEFORE the weight multiply; the result has
    x's dtype. Normalises over the last dim."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """KDA output norm: `(x / sqrt(mean(x^2) + eps)) * weight * sigmoid(gate)`, all fp32,
    cast to out_dtype. x, gate: [..., K]; weight: [K]."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(out_dtype)
