"""Routed-expert weights of one MoE layer, dense or MXFP4-packed.

Dense: `w1` (gate), `w3` (up) `[E, I, Din]` and `w2` `[E, Din, I]` parameters. Packed
(`--moe-weights packed`, the default for MXFP4 checkpoints in bf16): the checkpoint's `weight_packed`
`[E, O, I/2]` and `weight_scale` `[E, O, I/32]` uint8 tensors kept as they are, about 4.25 bits
per weight; each GEMM decodes its expert on the fly (exactly, so both modes compute the same
products). Execution is the backend's `experts` op (`ops.backend.TorchOps.experts`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.backend import ExpertWeights, GluAct
from ..parallel import shard
from .modules import OpsModule

PROJECTIONS = ("w1", "w3", "w2")


class StackedExperts(OpsModule):
    """All routed experts of a layer. The loader fills either the dense parameters or, through
    `set_packed`, the packed buffers `{w1,w3,w2}_packed` / `_scale` (validated MXFP4). `width` is
    this rank's share of the intermediate dim: w1/w3 are split by rows, w2 by columns (packed:
    by whole 32-element groups)."""

    def __init__(self, num_experts: int, width: int, d_in: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(num_experts, width, d_in))
        self.w3 = nn.Parameter(torch.zeros(num_experts, width, d_in))
        self.w2 = nn.Parameter(torch.zeros(num_experts, d_in, width))
        for param, dim in ((self.w1, 1), (self.w3, 1), (self.w2, 2)):
            shard(param, dim)
        self.num_experts, self.width, self.d_in = num_experts, width, d_in
        self.packed = False
        self.compute_dtype = None

    def set_packed(self, proj: str, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        """Replace dense `proj` by its packed form; activations run in `dtype`."""
        delattr(self, proj)
        self.register_buffer(f"{proj}_packed", packed)
        self.register_buffer(f"{proj}_scale", scale)
        self.packed, self.compute_dtype = True, dtype

    def weights(self) -> ExpertWeights:
        """The experts as the backend's `experts` op takes them (the tensors themselves, no copy)."""
        if not self.packed:
            return ExpertWeights(self.w1, self.w3, self.w2)
        return ExpertWeights(
            *((getattr(self, f"{p}_packed"), getattr(self, f"{p}_scale")) for p in PROJECTIONS),
            dtype=self.compute_dtype,
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: GluAct) -> torch.Tensor:
        """`ops.moe.grouped_experts` semantics: x [N, Din] -> [N, Din] in x's dtype."""
        return self.ops.experts(x, ids, weights, self.weights(), act)
