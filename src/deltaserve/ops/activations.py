"""GLU activations (spec/model.md §10): SiTU (K3) and SwiGLU (Kimi-Linear)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """`[beta*tanh(gate/beta)*sigmoid(gate)] * [linear_beta*tanh(up/linear_beta)]`, computed in
    fp32, cast back to gate's dtype. With linear_beta None the up branch passes unchanged.
    (float64 inputs are computed in float64.)"""
    acc = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(acc)
    u = up.to(acc)
    left = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    right = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return (left * right).to(gate.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` in the input dtype (as torch's nn.Linear MLPs compute it)."""
    return F.silu(gate) * up
