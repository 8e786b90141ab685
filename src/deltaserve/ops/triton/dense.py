"""`TritonDenseOps`: the dense, MoE and MLA-decode families on Triton kernels.

Overrides, each falling back to the `TorchOps` method (super()) for what it does not cover:
  rms_norm, attn_res  fused AttnRes mix + RMSNorm (`triton.norm`), fp32/bf16;
  route               the grouped top-k selection after the fp32 router GEMM (`triton.router`);
  experts             grouped GEMMs over the routed pairs, MXFP4 decoded in the weight loads,
                      SiTU or SwiGLU fused after gate/up (`triton.moe`), fp32/bf16 activations;
  mla_decode          paged absorbed decode attention over the pool rows in place (`triton.mla`),
                      through the view's page table where it has one (no flat row list).
Kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests); anything else
(float64, other devices, shapes a kernel refuses) takes the reference path. Each kernel matches its
reference within fp32 rounding: only summation orders differ.
"""

from __future__ import annotations

import torch

from ..attn_res import ATTN_RES_EPS
from ..backend import ExpertWeights, GluAct, RouteSpec, TorchOps
from . import interpreted
from . import mla as mla_kernels
from . import moe as moe_kernels
from .norm import mix_norm
from .router import route_select

_FLOATS = (torch.float32, torch.bfloat16)


def runs_here(*tensors: torch.Tensor) -> bool:
    """True where Triton can run on all `tensors`: CUDA, or CPU under the interpreter."""
    interp = interpreted()
    return all(t.is_cuda or (interp and t.is_cpu) for t in tensors)


class TritonDenseOps(TorchOps):
    """See the module docstring."""

    name = "triton"
    dense_families = {"norms": "triton", "attn_res": "triton", "moe": "triton", "mla": "triton (decode)"}

    def describe(self) -> dict[str, str]:
        return {**super().describe(), **self.dense_families}

    # dense -------------------------------------------------------------------------------------
    def rms_norm(self, x, w, eps, prepared=None):
        if x.dtype not in _FLOATS or not runs_here(x, w) or x.shape[-1] == 0:
            return super().rms_norm(x, w, eps, prepared)
        return mix_norm([x], None, w, 0.0, eps)

    def attn_res(self, cur, bank, proj, norm, prepared=None, then=None):
        """The mix and, with `then` = (w, eps, prepared), the RMSNorm after it in one kernel."""
        tensors = [cur, *bank, proj, norm] + ([then[0]] if then is not None else [])
        if (
            cur.dtype not in _FLOATS
            or not runs_here(*tensors)
            or any(t.shape != cur.shape or t.dtype != cur.dtype for t in bank)
        ):
            return super().attn_res(cur, bank, proj, norm, prepared, then)
        q = norm.reshape(-1).float() * proj.reshape(-1).float()
        w, eps = (None, 0.0) if then is None else then[:2]
        return mix_norm([*bank, cur], q, w, ATTN_RES_EPS, eps)

    # MoE ---------------------------------------------------------------------------------------
    def route(self, x, gate, bias, spec: RouteSpec, down=None):
        """fp32 logits as the reference computes them, then the fused selection kernel."""
        n_exp, groups = gate.shape[0], max(spec.num_expert_group, 1)
        allowed = n_exp if groups == 1 else spec.topk_group * (n_exp // groups)
        if (
            x.dtype not in _FLOATS
            or not runs_here(x, gate, *(() if bias is None else (bias,)))
            or n_exp % groups
            or spec.topk_group > groups
            or spec.top_k > allowed
        ):
            return super().route(x, gate, bias, spec, down)
        logits = x.float() @ gate.float().T
        weights, ids = route_select(logits, bias, *spec.args())
        return weights, ids, x if down is None else self.linear(x, down)

    def experts(self, x, ids, weights, ex: ExpertWeights, act: GluAct):
        """The grouped-GEMM kernels for fp32/bf16 activations; packed experts decode exactly to
        fp32 or bf16 (`ex.dtype`), dense ones are cast to x's dtype as the reference casts them."""
        ops = ex.operands()
        flat = [t for w in ops for t in (w if ex.packed else (w,))]
        if (
            x.dtype not in _FLOATS
            or x.dim() != 2
            or (ex.packed and ex.dtype not in _FLOATS)
            or not runs_here(x, ids, weights, *flat)
        ):
            return super().experts(x, ids, weights, ex, act)
        kind = moe_kernels.ACT_SITU if act.kind == "situ" else moe_kernels.ACT_SILU
        return moe_kernels.grouped_experts(x, ids, weights, *ops, kind, act.beta, act.linear_beta)

    # MLA ---------------------------------------------------------------------------------------
    def mla_decode(self, q, w_uk, w_uv, rows_view, rank, scale, prepared=None):
        """Absorb W_UK, the paged decode kernel over the pool rows, then W_UV (the layer's einsums)."""
        if rows_view is None:
            return None
        table = getattr(rows_view, "block_table", None)  # pages where the view has them: no flat rows
        if table is not None:
            rows, cu_kv, index = rows_view.rows, rows_view.cu_kv, table
            where = dict(block_table=table, page_size=rows_view.page_size)
        else:
            rows, index, cu_kv = rows_view
            where = dict(read_rows=index)
        if (
            q.dtype not in _FLOATS
            or rows.dtype not in (*_FLOATS, torch.float16)
            or rows.stride(-1) != 1
            or not runs_here(q, rows, index, cu_kv)
        ):
            return None
        nope = w_uk.shape[1]
        q_hat = torch.einsum("nhd,hdr->nhr", q[..., :nope], w_uk)
        q_lat = torch.cat([q_hat, q[..., nope:]], dim=-1)
        o_lat = mla_kernels.mla_decode_attention(q_lat, rows, cu_kv, rank, scale, **where)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)
