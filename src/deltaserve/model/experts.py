"""Routed-expert weights of one MoE layer, dense or MXFP4-packed, and their execution.

Dense: `w1` (gate), `w3` (up) `[E, I, Din]` and `w2` `[E, Din, I]` parameters. Packed
(`--moe-weights packed`, the default for MXFP4 checkpoints in bf16): the checkpoint's `weight_packed`
`[E, O, I/2]` and `weight_scale` `[E, O, I/32]` uint8 tensors kept as they are, about 4.25 bits
per weight; each GEMM decodes its expert on the fly (exactly, so both modes compute the same
products). In bf16 on CPU, batches of up to FUSED_MAX_TOKENS run the fused native kernel
(`kernels.cpu`), as do all batches where it has AMX tiles (one pass per expert chunk of up to 256
pairs, measured 1.6x the GEMM path at 2048 tokens); larger batches without AMX run `_grouped_native`
(per-expert oneDNN GEMMs with native GLU and combine); everything else runs
`ops.moe.grouped_experts`, the reference.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu import ACT_SILU, ACT_SITU, native
from ..ops.moe import grouped_experts
from ..ops.mxfp4 import mxfp4_decode

FUSED_MAX_TOKENS = 64   # above this many tokens, per-expert GEMMs (oneDNN) beat the fused GEMVs
ROW_BUCKET = 32        # prefill expert GEMMs run on row counts rounded up to a multiple of this
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
        self.num_experts, self.width, self.d_in = num_experts, width, d_in
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
        batches (any batch with AMX tiles) run the fused kernel; larger ones the per-expert GEMMs."""
        kernels = native(x.device) if x.dtype == torch.bfloat16 else None
        if kernels is None or not (self.packed or self.w1.dtype == torch.bfloat16):
            return grouped_experts(x, ids, weights, *self._views(), act)
        if 0 < x.shape[0] <= FUSED_MAX_TOKENS or kernels.amx:
            return kernels.moe_experts(x, ids, weights, *self._fused_operands(), self.act_kind,
                                       self.beta or 0.0, self.linear_beta)
        return self._grouped_native(x, ids, weights, kernels)

    @torch.no_grad()
    def _grouped_native(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, kernels) -> torch.Tensor:
        """`grouped_experts` for bf16 on CPU with fewer passes: one gather of the routed rows in
        expert order, per active expert one [M, 2I] gate+up GEMM (packed: both decoded into one
        buffer) or two GEMMs (dense), the native GLU on its halves, the down GEMM written straight
        into the expert-ordered outputs, then the native fp32 slot-order combination. Inference only.
        Each expert's GEMMs run on its rows rounded up to a multiple of ROW_BUCKET (the surplus
        rows are the next expert's or padding, overwritten or never read), so oneDNN sees few
        distinct shapes: a new shape costs ~4 ms of primitive creation, more than the GEMM."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        positions = torch.empty_like(order)
        positions[order] = torch.arange(order.numel())
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        pad = torch.zeros(ROW_BUCKET, dtype=order.dtype)
        xs = x[torch.cat([order // k, pad])]
        ys = torch.empty(n * k + ROW_BUCKET, self.d_in, dtype=torch.bfloat16)
        width = self.width
        if self.packed:
            w13 = torch.empty(2 * width, self.d_in, dtype=torch.bfloat16)
            w2 = torch.empty(self.d_in, width, dtype=torch.bfloat16)
        start = 0
        for e, m in enumerate(counts):
            if m == 0:
                continue
            rows = slice(start, start + -(-m // ROW_BUCKET) * ROW_BUCKET)
            start += m
            if self.packed:
                kernels.mxfp4_to_bf16(self.w1_packed[e], self.w1_scale[e], out=w13[:width])
                kernels.mxfp4_to_bf16(self.w3_packed[e], self.w3_scale[e], out=w13[width:])
                kernels.mxfp4_to_bf16(self.w2_packed[e], self.w2_scale[e], out=w2)
                h = torch.mm(xs[rows], w13.t())
                gate, up, down = h[:, :width], h[:, width:], w2
            else:
                gate, up, down = torch.mm(xs[rows], self.w1[e].t()), torch.mm(xs[rows], self.w3[e].t()), self.w2[e]
            act = kernels.glu_rows(gate, up, self.act_kind, self.beta or 0.0, self.linear_beta)
            torch.mm(act, down.t(), out=ys[rows])
        return kernels.moe_combine(ys[:n * k], positions.view(n, k), weights)
