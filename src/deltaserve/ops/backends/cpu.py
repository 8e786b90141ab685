"""`CpuNativeOps`: every op family on the native CPU kernels (`kernels.cpu`), for bf16 models.

Bound once per model by `ops.backends.select.select_ops` when the model is bf16 on CPU and the library
loaded; `CpuDenseOps` holds the dense and MoE families, this class adds KDA and MLA: the fused
decode steps over the pools in place, the whole-block plans, and the KDA prefill kernels (fused
conv + q/k L2 norm, the sigmoid gate, chunked prefill, the gated output norm) and the MLA prefill
attention's flash kernel; `CpuStackOps` the whole decode step in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.cpu import GATE_SIGMOID, GATE_SOFTPLUS, MAX_ROWS, MLA_MAX_HEADS, MLA_MAX_RANK
from ...kernels.cpu.blocks import KdaBlockWeights, MlaBlockWeights, kda_record_width
from ..fallbacks import fallback
from ..norms import gated_rms_norm
from ..operands import KdaSpec, KdaWeights, MlaWeights, ServedShapes, dtype_name
from .cpu_dense import CpuDenseOps
from .cpu_stack import CpuStackOps


@dataclass
class KdaPrepared:
    """A KDA layer's operands for the native kernels: its weights, their fp32 copies and the
    block plan (None where the block kernel does not apply; `block` keeps its tensors alive)."""

    w: KdaWeights
    spec: KdaSpec
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    plan: object = None
    block: KdaBlockWeights | None = None

    def gate_args(self) -> tuple[int, float]:
        sigmoid = self.spec.lower_bound is not None
        return (GATE_SIGMOID, self.spec.lower_bound) if sigmoid else (GATE_SOFTPLUS, 0.0)


@dataclass
class MlaPrepared:
    """An MLA layer's operands for the native decode kernels: W_UK^T [H, R, nope] and W_UV
    [H, v, R] as contiguous copies, the views they came from, and the block plan (or None)."""

    w: MlaWeights
    w_uk_t: torch.Tensor
    w_uv: torch.Tensor
    plan: object = None
    block: MlaBlockWeights | None = None


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def _mla_reason(heads: int, rank: int) -> str:
    """Why the native MLA decode kernel refuses bf16 queries: the pool's dtype or the model's shape."""
    return "shape" if heads > MLA_MAX_HEADS or rank > MLA_MAX_RANK else "cache_dtype"


class CpuNativeOps(CpuStackOps, CpuDenseOps):
    """See the module docstring (`fuse_blocks`: see `CpuDenseOps`; `fuse_stack`: `CpuStackOps`;
    `flash_prefill`: the MLA prefill attention on the native flash kernel, else SDPA).
    `chains_decode_rows`: in a decode step, adjacent rows on one KDA slot are applied in row order
    (`ds_kda_decode`), so a sequence's k + 1 tokens may run as k + 1 rows (a speculative verify)."""

    chains_decode_rows = True

    def __init__(self, kernels, fuse_blocks: bool = True, fuse_stack: bool = True, flash_prefill: bool = True):
        super().__init__(kernels, fuse_blocks)
        self.fuse_stack = fuse_stack
        self.flash_prefill = flash_prefill

    def describe(self, served: ServedShapes | None = None) -> dict[str, str]:
        """`CpuDenseOps.describe`, the KDA and MLA families with what their kernels leave to torch or to
        other kernels for `served` (the softplus gate, bf16 states, heads or rank beyond MLA_MAX_HEADS /
        MLA_MAX_RANK, no flash kernel)."""
        out = super().describe(served)
        if served is None or served.dtype != torch.bfloat16:
            return out
        native, kda, mla = out["kda"], [], []
        if served.kda_gate == "softplus":
            kda.append("softplus gate on torch")
        if served.state_dtype != torch.float32:
            kda.append(f"decode on torch: the kernels keep fp32 states, not {dtype_name(served.state_dtype)}")
        if served.mla_heads > MLA_MAX_HEADS or served.mla_rank > MLA_MAX_RANK:
            rows = "flash kernel" if self.flash_prefill and self.k.avx512_bf16 else "torch"
            mla.append(
                f"decode on {rows} over gathered rows: {served.mla_heads} heads or rank {served.mla_rank} too large"
            )
        if not (self.flash_prefill and self.k.avx512_bf16):
            mla.append("prefill on torch SDPA")
        for family, notes in (("kda", kda), ("mla", mla)):
            out[family] = f"{native} [{', '.join(notes)}]" if notes else native
        return out

    # KDA ---------------------------------------------------------------------------------------
    def prepare_kda(self, w: KdaWeights, spec: KdaSpec) -> KdaPrepared:
        p = KdaPrepared(w, spec, _f32(w.conv), _f32(w.a_log), _f32(w.dt_bias), _f32(w.norm))
        if self.fuse_blocks:
            p.block = KdaBlockWeights(
                w.q,
                w.k,
                w.v,
                w.f_a,
                w.f_b,
                w.b,
                w.g,
                w.g_b,
                w.o,
                conv_w=p.conv,
                a_log=p.a_log,
                dt_bias=p.dt_bias,
                norm_w=p.norm,
            )
            p.plan = self.k.kda_block_plan(p.block, spec.heads, *p.gate_args(), spec.eps, spec.scale)
        return p

    def kda_decode(self, x, prepared: KdaPrepared | None, slot_view, otherwise, record=None):
        """The whole step in one call (the block plan) where it fits, else the fused decode kernel
        between the native projections; `otherwise()` for non-bf16 activations or pools. Either
        native way fills the layer's `record` where the layer has a block plan (the replay's)."""
        if prepared is None or slot_view is None:
            return otherwise()
        tails, states, slots = slot_view
        if x.dtype != torch.bfloat16 or tails.dtype != torch.bfloat16 or states.dtype != torch.float32:
            fallback("kda_decode", "dtype" if x.dtype != torch.bfloat16 else "cache_dtype")
            return otherwise()
        plan = prepared.plan
        buf = None if record is None or plan is None else record(plan, kda_record_width(plan))
        if plan is not None and x.shape[0] <= self.k.kda_block_rows(plan):
            return self.k.kda_block(plan, x, tails, states, slots, buf)
        w, spec = prepared.w, prepared.spec
        q, k, v, f_a, b, g = self.linears(x, [w.q, w.k, w.v, w.f_a, w.b, w.g])
        gate = g if w.g_b is None else self.linear(g, w.g_b)
        kind, bound = prepared.gate_args()
        f = self.linear(f_a, w.f_b)
        if buf is not None:  # the planes `kda_block` records
            n, p = q.shape
            for plane, t in zip(buf[: 4 * n * p].view(4, n, p), (q, k, v, f)):
                plane.copy_(t)
            buf[4 * n * p :].view(n, -1).copy_(b)
        o = self.k.kda_decode(
            q,
            k,
            v,
            prepared.conv,
            tails,
            states,
            slots,
            f,
            prepared.a_log,
            prepared.dt_bias,
            kind,
            bound,
            b,
            gate,
            prepared.norm,
            spec.eps,
            spec.scale,
        )
        return self.linear(o, w.o)

    def kda_attend(
        self,
        pre,
        f,
        beta,
        gate,
        conv,
        a_log,
        dt_bias,
        norm,
        spec,
        cu_seqlens,
        prior,
        export_offsets,
        step,
        prepared: KdaPrepared | None = None,
    ):
        """Prefill of bf16 activations (and bf16 cached tails): the conv kernel also L2-normalises
        q and k, then the sigmoid gate, chunked prefill and gated output norm kernels."""
        if (
            step
            or prepared is None
            or pre.dtype != torch.bfloat16
            or (prior is not None and prior[0].dtype != torch.bfloat16)
        ):
            if not step:  # a step: counted where `kda_decode` declined it
                why = "unprepared" if prepared is None else "dtype" if pre.dtype != torch.bfloat16 else "cache_dtype"
                fallback("kda_attend", why)
            return super().kda_attend(
                pre, f, beta, gate, conv, a_log, dt_bias, norm, spec, cu_seqlens, prior, export_offsets, step, prepared
            )
        n, h, dk = pre.shape[0], spec.heads, spec.head_dim
        mixed, tail = self.k.causal_conv1d(
            pre, prepared.conv, cu_seqlens, prior[0] if prior is not None else None, l2_groups=2 * h, group=dk
        )
        q, k, v = mixed.view(n, 3, h, dk).unbind(1)
        f = f.view(n, h, dk)
        if spec.lower_bound is not None:
            g = self.k.kda_gate_sigmoid(f, prepared.a_log, prepared.dt_bias, spec.lower_bound)
        else:
            fallback("kda_gate", "variant")  # the softplus gate (Kimi-Linear) has no native kernel
            g = self._kda_gate(f, a_log, dt_bias, spec)
        o, state, states_at = self.k.kda_chunked(
            q,
            k,
            v,
            g,
            beta,
            cu_seqlens,
            spec.scale,
            initial_state=prior[1] if prior is not None else None,
            export_offsets=export_offsets,
        )
        exported = self._exports(pre, cu_seqlens, prior, export_offsets, conv.shape[-1], states_at)
        if gate.dtype == torch.bfloat16:
            o = self.k.gated_rms_norm(o, prepared.norm, gate, spec.eps)
        else:
            fallback("gated_rms_norm", "dtype")
            o = gated_rms_norm(o, norm, gate, spec.eps, pre.dtype)
        return o, tail, state, exported

    # MLA ---------------------------------------------------------------------------------------
    def prepare_mla(self, w: MlaWeights) -> MlaPrepared:
        p = MlaPrepared(w, w.w_uk.detach().transpose(1, 2).contiguous(), w.w_uv.detach().contiguous())
        if self.fuse_blocks:
            p.block = MlaBlockWeights(
                w.q_first,
                w.q_b,
                None if w.q_norm is None else _f32(w.q_norm),
                w.kv_a,
                _f32(w.kv_norm),
                w.g,
                p.w_uk_t,
                p.w_uv,
            )
            p.plan = self.k.mla_block_plan(p.block, w.heads, w.nope, w.rope, w.q_eps, w.kv_eps, w.scale)
        return p

    def mla_block(self, x, prepared: MlaPrepared | None, pool_view, otherwise):
        """The block plan over bf16 activations and pool within its rows, else `otherwise()` (not a
        fallback: the layer's path runs the per-op kernels)."""
        if (
            prepared is None
            or prepared.plan is None
            or pool_view is None
            or x.dtype != torch.bfloat16
            or x.shape[0] > self.k.mla_block_rows(prepared.plan)
            or pool_view[0].dtype != torch.bfloat16
        ):
            return otherwise()
        return self.k.mla_block(prepared.plan, x, *pool_view)

    def mla_prefill(self, q, k_nope, k_rot, v, cu_seqlens, scale):
        out = self._flash(q, k_nope, k_rot, v, cu_seqlens, cu_seqlens, scale)
        return super().mla_prefill(q, k_nope, k_rot, v, cu_seqlens, scale) if out is None else out

    def mla_context_prefill(self, q, k_nope, k_rot, v, cu_q, cu_kv, scale):
        out = self._flash(q, k_nope, k_rot, v, cu_q, cu_kv, scale, op="mla_context_prefill")
        return super().mla_context_prefill(q, k_nope, k_rot, v, cu_q, cu_kv, scale) if out is None else out

    def mla_absorbed(self, q_latent, rows, cu_q, cu_kv, rank, scale):
        """The flash kernel as MQA: one key head (the latent rows, read in place), the query heads
        folded into rows."""
        nq, h, d = q_latent.shape
        latent = rows[:, None, :rank]
        out = self._flash(
            q_latent.reshape(nq * h, 1, d), latent, rows[:, rank:], latent, cu_q, cu_kv, scale, h, "mla_absorbed"
        )
        return super().mla_absorbed(q_latent, rows, cu_q, cu_kv, rank, scale) if out is None else out.view(nq, h, rank)

    def unabsorbed_row_bytes(self, heads, rope, nope, v):
        """On the flash kernel a decompressed row is its keys' and values' `kv_b_proj` output alone
        (read in place; the kernel's packed blocks are bounded apart, `FLASH_PACK_BYTES`): 4 KiB at 8 of
        K3's heads against SDPA's 10."""
        if self.flash_prefill and self.k.avx512_bf16:
            return heads * 2 * (nope + v)
        return super().unabsorbed_row_bytes(heads, rope, nope, v)

    def _flash(self, q, k_nope, k_rot, v, cu_q, cu_kv, scale, group: int = 1, op: str = "mla_prefill"):
        """MLA prefill attention on the native flash kernel (keys' parts and values read in place), or
        None, a fallback of `op`: switched off, operands other than bf16, or a build without AVX512-BF16."""
        if not self.flash_prefill or any(t.dtype != torch.bfloat16 or t.stride(-1) != 1 for t in (q, k_nope, k_rot, v)):
            bf16 = all(t.dtype == torch.bfloat16 for t in (q, k_nope, k_rot, v))
            fallback(op, "disabled" if not self.flash_prefill else "layout" if bf16 else "dtype")
            return None
        out = self.k.flash_attention(q, k_nope, k_rot, v, cu_q.long(), cu_kv.long(), scale, group)
        if out is None:
            fallback(op, "isa")
        return out

    def mla_decode_partial(self, q_latent, rows_view, rank, scale):
        rows = rows_view[0]
        if (
            q_latent.dtype != torch.bfloat16
            or rows.dtype != torch.bfloat16
            or q_latent.shape[1] > MLA_MAX_HEADS
            or rank > MLA_MAX_RANK
        ):
            fallback(
                "mla_decode_partial",
                "dtype" if q_latent.dtype != torch.bfloat16 else _mla_reason(q_latent.shape[1], rank),
            )
            return None
        return self.k.mla_decode_partial(q_latent, *rows_view, rank, scale)

    def mla_decode(self, q, w_uk, w_uv, rows_view, rank, scale, prepared: MlaPrepared | None = None):
        """The paged decode kernel reading the pool's rows in place; up to MAX_ROWS queries also
        absorb W_UK and W_UV with the per-head GEMV kernel."""
        if prepared is None or rows_view is None:
            return None
        if (
            q.dtype != torch.bfloat16
            or q.shape[1] > MLA_MAX_HEADS
            or rank > MLA_MAX_RANK
            or rows_view[0].dtype != torch.bfloat16
        ):
            fallback("mla_decode", "dtype" if q.dtype != torch.bfloat16 else _mla_reason(q.shape[1], rank))
            return None
        rows, read_rows, cu_kv = rows_view
        nope = w_uk.shape[1]
        if q.shape[0] > MAX_ROWS:
            q_hat = torch.einsum("nhd,hdr->nhr", q[..., :nope], w_uk)
            o_lat = self.k.mla_decode(torch.cat([q_hat, q[..., nope:]], dim=-1), rows, read_rows, cu_kv, rank, scale)
            return torch.einsum("nhr,hvr->nhv", o_lat, w_uv)
        q_hat = self.k.linear_bf16_heads(q[..., :nope].transpose(0, 1), prepared.w_uk_t).transpose(0, 1)
        o_lat = self.k.mla_decode(torch.cat([q_hat, q[..., nope:]], dim=-1), rows, read_rows, cu_kv, rank, scale)
        return self.k.linear_bf16_heads(o_lat.transpose(0, 1), prepared.w_uv).transpose(0, 1)
