"""`TritonDenseOps`: the dense, MoE and MLA-decode families on Triton kernels.

Overrides, each falling back to the `TorchOps` method (super()) for what it does not cover:
  rms_norm, attn_res  fused AttnRes mix + RMSNorm (`triton.norm`), fp32/bf16;
  route               the grouped top-k selection after the fp32 router GEMM (`triton.router`);
  experts             grouped GEMMs over the routed pairs, MXFP4 decoded in the weight loads,
                      SiTU or SwiGLU fused after gate/up (`triton.moe`), fp32/bf16 activations;
                      OpenAI's `triton_kernels` `matmul_ogs` instead where enabled and it fits
                      (`.ogs_moe`, opt-in: its converted copy doubles the experts' memory);
  mla_decode          paged absorbed decode attention over the pool rows in place: FlashInfer's MLA
                      kernel where it imports and fits (`.flashinfer_mla`: CUDA, bf16/fp16, rank
                      512 + rope 64), else ours (`triton.mla`), through the view's page table
                      where it has one (no flat row list);
  mla_extend          absorbed attention of many queries per sequence over the pool through the
                      page table (prefill over a cached prefix, mixed steps; `triton.mla_prefill`);
  mla_prefill         causal unabsorbed attention of fresh prompts: torch's FlashAttention varlen
                      kernel on CUDA in half precision (`.flash_prefill`), else ours, which reads
                      the keys as their two parts in place.
Kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests); anything else
(float64, other devices, shapes a kernel refuses) takes the reference path. Each kernel matches its
reference within fp32 rounding: only summation orders differ.
"""

from __future__ import annotations

import torch

from ...kernels.extern import flash_prefill, flashinfer_mla, ogs_moe
from ...kernels.triton import interpreted
from ...kernels.triton import mla as mla_kernels
from ...kernels.triton import mla_prefill as mla_prefill_kernels
from ...kernels.triton import moe as moe_kernels
from ...kernels.triton.norm import mix_norm
from ...kernels.triton.router import route_select
from ..attn_res import ATTN_RES_EPS
from ..fallbacks import fallback
from ..operands import ExpertWeights, GluAct, RouteSpec
from .torch import TorchOps

_FLOATS = (torch.float32, torch.bfloat16)


def why_not(dtype: torch.dtype, *tensors: torch.Tensor) -> str:
    """The fallback reason of operands the kernels refuse: their dtype, else their device, else their shape."""
    return "dtype" if dtype not in _FLOATS else "device" if not runs_here(*tensors) else "shape"


def runs_here(*tensors: torch.Tensor) -> bool:
    """True where Triton can run on all `tensors`: CUDA, or CPU under the interpreter."""
    interp = interpreted()
    return all(t.is_cuda or (interp and t.is_cpu) for t in tensors)


def _latent_reason(q: torch.Tensor, rows: torch.Tensor, *index: torch.Tensor) -> str:
    """Why `_latent_fits` refused: the queries' or the pool's dtype, the devices, the rows' layout."""
    if q.dtype not in _FLOATS:
        return "dtype"
    if rows.dtype not in (*_FLOATS, torch.float16):
        return "cache_dtype"
    return "device" if not runs_here(q, rows, *index) else "layout"


class TritonDenseOps(TorchOps):
    """See the module docstring."""

    name = "triton"
    dense_families = {"norms": "triton", "attn_res": "triton"}

    def describe(self, served=None) -> dict[str, str]:
        """The optional libraries that import, and for `served` only those whose windows admit the
        model (half precision; FlashInfer's (rank, rope) widths; the flash prefill's head width)."""
        half = served is None or served.dtype in (torch.bfloat16, torch.float16)
        fi = served is None or (served.mla_rank, served.mla_rope) == flashinfer_mla._WIDTHS
        fp = served is None or served.mla_width <= flash_prefill._MAX_WIDTH
        libs = (("flashinfer-decode", flashinfer_mla, fi), ("torch-flash-prefill", flash_prefill, fp))
        mla = "+".join(["triton", *(name for name, lib, fits in libs if half and fits and lib.available())])
        moe = (
            "triton+triton_kernels"
            if ogs_moe.available() and (served is None or served.dtype == torch.bfloat16)
            else "triton"
        )
        return {**super().describe(served), **self.dense_families, "mla": mla, "moe": moe}

    # dense -------------------------------------------------------------------------------------
    def rms_norm(self, x, w, eps, prepared=None):
        if x.dtype not in _FLOATS or not runs_here(x, w) or x.shape[-1] == 0:
            fallback("rms_norm", why_not(x.dtype, x, w))
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
            fallback("attn_res", why_not(cur.dtype, *tensors))
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
            fallback("route", why_not(x.dtype, x, gate, *(() if bias is None else (bias,))))
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
            fallback(
                "experts",
                "dtype" if ex.packed and ex.dtype not in _FLOATS else why_not(x.dtype, x, ids, weights, *flat),
            )
            return super().experts(x, ids, weights, ex, act)
        prepared = ogs_moe.prepared_for(ex)
        if prepared is not None and ogs_moe.fits(x, ex, act):
            return ogs_moe.experts(x, ids, weights, prepared, act)
        kind = moe_kernels.ACT_SITU if act.kind == "situ" else moe_kernels.ACT_SILU
        return moe_kernels.grouped_experts(x, ids, weights, *ops, kind, act.beta, act.linear_beta)

    def prepare_experts(self, ex: ExpertWeights, act: GluAct) -> None:
        """The routed experts (an expert-parallel slice too) in `triton_kernels`' layout where it
        is enabled and fits (`.ogs_moe` keeps them, keyed by the packed tensors)."""
        if ogs_moe.weights_fit(ex, act):
            ogs_moe.prepare(ex)

    # MLA ---------------------------------------------------------------------------------------
    def mla_prefill(self, q, k_nope, k_rot, v, cu_seqlens, scale):
        """torch's FlashAttention varlen kernel where it fits (`.flash_prefill`), else ours."""
        if flash_prefill.fits(q, v.shape[-1]):
            return flash_prefill.prefill(q, k_nope, k_rot, v, cu_seqlens, scale)
        tensors = (q, k_nope, k_rot, v, cu_seqlens)
        if q.dtype not in _FLOATS or not runs_here(*tensors) or any(t.stride(-1) != 1 for t in tensors[:4]):
            fallback("mla_prefill", why_not(q.dtype, *tensors).replace("shape", "layout"))
            return super().mla_prefill(q, k_nope, k_rot, v, cu_seqlens, scale)
        return mla_prefill_kernels.mla_prefill_attention(q, k_nope, k_rot, v, cu_seqlens, scale)

    def mla_extend(self, q, w_uk, w_uv, rows_view, cu_q, rank, scale):
        """Absorb W_UK, the paged kernel over each sequence's context, then W_UV; None without a
        page table in the view or where the kernel does not run."""
        table = getattr(rows_view, "block_table", None)
        if table is None or not self._latent_fits(q, rows_view.rows, table, rows_view.cu_kv, cu_q):
            fallback("mla_extend", "layout" if table is None else _latent_reason(q, rows_view.rows, table))
            return None
        o_lat = mla_prefill_kernels.mla_extend_attention(
            self._absorb(q, w_uk), rows_view.rows, table, rows_view.page_size, cu_q, rows_view.cu_kv, rank, scale
        )
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)

    @staticmethod
    def _latent_fits(q, rows, *index) -> bool:
        return (
            q.dtype in _FLOATS
            and rows.dtype in (*_FLOATS, torch.float16)
            and rows.stride(-1) == 1
            and runs_here(q, rows, *index)
        )

    @staticmethod
    def _absorb(q, w_uk):
        """[W_UK^T q_nope | q_rot] per head."""
        nope = w_uk.shape[1]
        return torch.cat([torch.einsum("nhd,hdr->nhr", q[..., :nope], w_uk), q[..., nope:]], dim=-1)

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
        if not self._latent_fits(q, rows, index, cu_kv):
            fallback("mla_decode", _latent_reason(q, rows, index, cu_kv))
            return None
        q_lat, o_lat = self._absorb(q, w_uk), None
        if table is not None and flashinfer_mla.fits(q_lat, rows, rank, rows_view.page_size):
            o_lat = flashinfer_mla.decode(q_lat, rows_view, rank, scale)  # None: it refused the step
        if o_lat is None:
            o_lat = mla_kernels.mla_decode_attention(q_lat, rows, cu_kv, rank, scale, **where)
        return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)
