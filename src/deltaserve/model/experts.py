"""Routed-expert weights of one MoE layer, dense or MXFP4-packed, and their execution.

Dense: `w1` (gate), `w3` (up) `[E, I, Din]` and `w2` `[E, Din, I]` parameters. Packed
(`--moe-weights packed`, the default for MXFP4 checkpoints in bf16): the checkpoint's `weight_packed`
`[E, O, I/2]` and `weight_scale` `[E, O, I/32]` uint8 tensors kept as they are, about 4.25 bits
per weight; each GEMM decodes its expert on the fly (exactly, so both modes compute the same
products). Small batches on CPU run the fused native kernel (`ops.cpu_kernels`); everything else
runs `ops.moe.grouped_experts`, the reference.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ..ops.cpu_kernels import ACT_SILU, ACT_SITU, native
from ..ops.moe import grouped_experts
from ..ops.mxfp4 import mxfp4_decode

FUSED_MAX_TOKENS = 64   # above this many tokens, per-expert GEMMs (oneDNN) beat the fused GEMVs
PROJECTIONS = ("w1", "w3", "w2")


class PackedExpertView:
    """`[E, O, I]`-shaped read access to packed experts: `view[e]` decodes expert e to `dtype`."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.packed, self.scale, self.dtype = packed, scale, dtype
        self.shape = torch.Size((*packed.shape[:2], packed.shape[2] * 2))

    def __getitem__(self, e: int) -> torch.Tensor:
        kernels = native(self.packed.device)
        if kernels is not None and self.dtype == torch.bfloat16:
            return kernels.mxfp4_to_bf16(self.packed[e], self.scale[e])
        return mxfp4_decode(self.packed[e], self.scale[e], self.dtype)


class StackedExperts(nn.Module):
    """All routed experts of a layer. The loader fills either the dense parameters or, through
    `set_packed`, the packed buffers `{w1,w3,w2}_packed` / `_scale` (validated MXFP4)."""

    def __init__(self, num_experts: int, width: int, d_in: int, act: str, beta: float | None,
                 linear_beta: float | None):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(num_experts, width, d_in))
        self.w3 = nn.Parameter(torch.zeros(num_experts, width, d_in))
        self.w2 = nn.Parameter(torch.zeros(num_experts, d_in, width))
        self.packed = False
        self.compute_dtype = None
        self.act_kind = ACT_SITU if act == "situ" else ACT_SILU
        self.beta, self.linear_beta = beta, linear_beta

    def set_packed(self, proj: str, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        """Replace dense `proj` by its packed form; activations run in `dtype`."""
        delattr(self, proj)
        self.register_buffer(f"{proj}_packed", packed)
        self.register_buffer(f"{proj}_scale", scale)
        self.packed, self.compute_dtype = True, dtype

    def _views(self):
        if not self.packed:
            return self.w1, self.w3, self.w2
        return tuple(PackedExpertView(getattr(self, f"{p}_packed"), getattr(self, f"{p}_scale"),
                                      self.compute_dtype) for p in PROJECTIONS)

    def _fused_operands(self):
        if self.packed:
            return tuple((getattr(self, f"{p}_packed"), getattr(self, f"{p}_scale")) for p in PROJECTIONS)
        return self.w1, self.w3, self.w2

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act) -> torch.Tensor:
        """`grouped_experts` semantics (x [N, Din] -> [N, Din] in x's dtype). bf16 on CPU: small
        batches run the fused kernel; larger ones the per-expert GEMMs with the native GLU."""
        kernels = native(x.device) if x.dtype == torch.bfloat16 else None
        if kernels is None:
            return grouped_experts(x, ids, weights, *self._views(), act)
        if 0 < x.shape[0] <= FUSED_MAX_TOKENS and (self.packed or self.w1.dtype == torch.bfloat16):
            return kernels.moe_experts(x, ids, weights, *self._fused_operands(), self.act_kind,
                                       self.beta or 0.0, self.linear_beta)
        glu = functools.partial(kernels.glu, act=self.act_kind, beta=self.beta or 0.0,
                                linear_beta=self.linear_beta)
        return grouped_experts(x, ids, weights, *self._views(), glu)
