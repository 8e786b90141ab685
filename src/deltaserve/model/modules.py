"""Small building blocks whose parameter names match the checkpoint (`<name>.weight`).

Every module whose forward computes derives from `OpsModule`: it calls the op backend in
`self.ops` (the reference `TorchOps` until `model.fused.prepare_model` binds the model's
backend) and reads what that backend prepared from its weights in `self.prepared` (None: nothing
prepared, the reference operands). Both are plain attributes, never saved or counted.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.backends.torch import REFERENCE, TorchOps


class OpsModule(nn.Module):
    """A module bound to an op backend (see the module docstring)."""

    ops: TorchOps = REFERENCE
    prepared = None


def project(x: torch.Tensor, *layers: nn.Linear, f32: tuple[bool, ...] | None = None) -> list[torch.Tensor]:
    """`[layer(x) for layer in layers]` through the first layer's backend (one pass over all their
    weights where it can); outputs where `f32[i]` are the fp32 `x.float() @ w.float().T`."""
    return layers[0].ops.linears(x, [m.weight for m in layers], f32)


class Linear(nn.Linear, OpsModule):
    """Bias-free `nn.Linear` whose forward is the backend's `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


def empty_linear(in_features: int, out_features: int) -> Linear:
    """A bias-free linear layer (every linear layer in this family is bias-free)."""
    return Linear(in_features, out_features, bias=False)


class RMSNorm(OpsModule):
    """KimiRMSNorm with an explicit eps (each use site has its own, spec §3)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def operands(self) -> tuple:
        """(weight, eps, prepared): what `ops.rms_norm` takes after x (and `ops.attn_res` as `then`)."""
        return self.weight, self.eps, self.prepared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.prepared)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class WeightVector(OpsModule):
    """A lone `weight` tensor (AttnRes projections [1, D] and score norms [D])."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*shape))

    def flat(self) -> torch.Tensor:
        return self.weight.reshape(-1)


def attn_res(
    cur: torch.Tensor, bank: list[torch.Tensor], proj: WeightVector, norm: WeightVector, then: RMSNorm | None = None
) -> torch.Tensor:
    """`ops.attn_res.attn_res_mix(cur, bank, proj, norm)`, then `then` (the layer's next RMSNorm)
    if given, as one backend op; the mix's prepared operand lives on `proj`."""
    if not bank:
        return cur if then is None else then(cur)
    return proj.ops.attn_res(
        cur, bank, proj.flat(), norm.flat(), proj.prepared, None if then is None else then.operands()
    )
