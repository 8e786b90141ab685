"""Small building blocks whose parameter names match the checkpoint (`<name>.weight`)."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.norms import rms_norm


def empty_linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear layer (every linear layer in this family is bias-free)."""
    return nn.Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    """KimiRMSNorm with an explicit eps (each use site has its own, spec §3)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class WeightVector(nn.Module):
    """A lone `weight` tensor (AttnRes projections [1, D] and score norms [D])."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*shape))

    def flat(self) -> torch.Tensor:
        return self.weight.reshape(-1)
