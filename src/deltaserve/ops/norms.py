"""RMSNorm variants (spec/model.md §3). Each use site passes its own eps.

Inputs of at most fp32 precision are normalised in fp32; float64 inputs stay float64 (so the
ops can be checked against float64 oracles)."""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm: `weight * cast_to_x_dtype(x_f32 * rsqrt(mean(x_f32^2) + eps))`.
    The normalised value is cast back to x's dtype BEFORE the weight multiply; the result has
    x's dtype. Normalises over the last dim."""
    xf = x.to(_acc_dtype(x.dtype))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """KDA output norm: `(x / sqrt(mean(x^2) + eps)) * weight * sigmoid(gate)`, all fp32,
    cast to out_dtype. x, gate: [..., K]; weight: [K]."""
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(acc) * torch.sigmoid(gate.to(acc))).to(out_dtype)
