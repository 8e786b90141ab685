"""`TritonOps`: the Triton backend, bound once per model by `ops.backends.select.select_ops` on CUDA (or on
CPU under `TRITON_INTERPRET=1` with `DELTASERVE_TRITON=1`, how it is tested without a GPU).

`TritonDenseOps` (`.dense`) holds the MLA, MoE, AttnRes and norm kernels; this class adds KDA:
the chunked prefill with state export at the requested offsets in the one pass (`.kda`; fla-core's
kernel instead for half-precision models where it imports and no export is asked for), and the
decode step over the slot pool in place (conv tail shift and recurrent update). Conv, L2 norm,
gate and output norm of the prefill stay on the PyTorch ops; for fp32 models every method gives
the reference result up to fp32 rounding (`tl.dot` in IEEE fp32; TF32 for half-precision models).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.extern import fla_kda
from ...kernels.triton import interpreted
from ...kernels.triton.kda import GATE_SIGMOID, GATE_SOFTPLUS, chunk_kda, conv_step, recurrent_step
from .. import kda as kda_ops
from ..fallbacks import fallback
from ..norms import gated_rms_norm
from ..operands import KdaSpec, KdaWeights, ServedShapes, dtype_name
from .torch import TorchOps
from .triton_dense import TritonDenseOps


@dataclass
class KdaPrepared:
    """A KDA layer's weights with fp32 contiguous copies of the small ones the kernels read."""

    w: KdaWeights
    spec: KdaSpec
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor

    @property
    def gate(self) -> int:
        return GATE_SOFTPLUS if self.spec.lower_bound is None else GATE_SIGMOID


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _runs_here(*tensors: torch.Tensor) -> bool:
    """CUDA tensors, or CPU ones under the interpreter, of a dtype the kernels take."""
    return all((t.is_cuda or (t.is_cpu and interpreted())) and t.dtype in _DTYPES for t in tensors)


def _state_reason(x: torch.Tensor, tails: torch.Tensor, states: torch.Tensor) -> str:
    """Why the decode step declines: the activations' dtype, the pool's (the recurrent kernel keeps
    fp32 states), the devices, or non-contiguous states."""
    if x.dtype not in _DTYPES:
        return "dtype"
    if tails.dtype not in _DTYPES or states.dtype != torch.float32:
        return "cache_dtype"
    return "device" if not _runs_here(x, tails, states) else "layout"


def _precision(dtype: torch.dtype) -> str:
    """`tl.dot` precision: exact fp32 for fp32 models, TF32 tensor cores for half-precision ones."""
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonOps(TritonDenseOps, TorchOps):
    """See the module docstring."""

    name = "triton"

    def describe(self, served: ServedShapes | None = None) -> dict[str, str]:
        out = super().describe(served)
        half = served is None or served.dtype in (torch.bfloat16, torch.float16)
        out["kda"] = "triton+fla-prefill" if half and fla_kda.available() else "triton"
        if served is not None and served.state_dtype != torch.float32:
            out["kda"] += (
                f" [decode on torch: the recurrent kernel keeps fp32 states, not {dtype_name(served.state_dtype)}]"
            )
        return out

    def prepare_kda(self, w: KdaWeights, spec: KdaSpec) -> KdaPrepared:
        return KdaPrepared(w, spec, _f32(w.conv), _f32(w.a_log), _f32(w.dt_bias))

    def kda_decode(self, x: torch.Tensor, prepared: KdaPrepared | None, slot_view, otherwise, record=None):
        """The decode step over the pool's slots in place: projections, conv step kernel (tails
        shift), recurrent kernel (L2 norm, gate, state update), output norm, o_proj. `otherwise()`
        where the pool is not contiguous with fp32 states."""
        if prepared is None or slot_view is None:
            return otherwise()
        tails, states, slots = slot_view
        if not _runs_here(x, tails, states) or states.dtype != torch.float32 or not states.is_contiguous():
            fallback("kda_decode", _state_reason(x, tails, states))
            return otherwise()
        if not tails.is_contiguous():
            fallback("kda_decode", "layout")
            return otherwise()
        w, spec = prepared.w, prepared.spec
        n, h, dk = x.shape[0], spec.heads, spec.head_dim
        q, k, v, f_a, b, g = self.linears(x, [w.q, w.k, w.v, w.f_a, w.b, w.g])
        mixed = conv_step(torch.cat([q, k, v], dim=-1), prepared.conv, tails, slots)
        f = self.linear(f_a, w.f_b)
        beta = torch.sigmoid(b.float())
        o = recurrent_step(
            mixed, f, beta, states, slots, spec.scale, h, prepared.gate, prepared.a_log, prepared.dt_bias,
            spec.lower_bound or 0.0,
        )  # fmt: skip
        gate = (g if w.g_b is None else self.linear(g, w.g_b)).view(n, h, dk)
        return self.linear(gated_rms_norm(o, w.norm, gate, spec.eps, x.dtype).reshape(n, h * dk), w.o)

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
        """`TorchOps.kda_attend` with the chunked and recurrent parts on the kernels."""
        n, h, dk = pre.shape[0], spec.heads, spec.head_dim
        if not _runs_here(pre) or (step and (prior[1].dtype != torch.float32 or not prior[1].is_contiguous())):
            if not step:  # a step: counted where `kda_decode` declined it
                fallback("kda_attend", "device" if pre.dtype in _DTYPES else "dtype")
            return super().kda_attend(
                pre, f, beta, gate, conv, a_log, dt_bias, norm, spec, cu_seqlens, prior, export_offsets, step
            )
        if step:
            tails, states = prior
            mixed, tail = kda_ops.causal_conv1d_step(pre, conv, tails)
            slots = torch.arange(n, device=pre.device)
            kind = GATE_SOFTPLUS if spec.lower_bound is None else GATE_SIGMOID
            o = recurrent_step(
                mixed, f, beta, states, slots, spec.scale, h, kind, a_log, dt_bias, spec.lower_bound or 0.0
            )
            return gated_rms_norm(o, norm, gate, spec.eps, pre.dtype), tail, states, None
        mixed, tail = kda_ops.causal_conv1d(pre, conv, cu_seqlens, prior[0] if prior is not None else None)
        q, k, v = mixed.view(n, 3, h, dk).unbind(1)
        q, k = kda_ops.l2_norm(q), kda_ops.l2_norm(k)
        g = self._kda_gate(f.view(n, h, dk), a_log, dt_bias, spec)
        state = prior[1] if prior is not None else None
        if fla_kda.fits(q, pre.dtype, export_offsets):
            o, state = fla_kda.chunk_kda(q, k, v, g, beta, cu_seqlens, spec.scale, state, dtype=pre.dtype)
            states_at = None if export_offsets is None else state.new_empty(0, *state.shape[1:])
        else:
            o, state, states_at = chunk_kda(
                q, k, v, g, beta, cu_seqlens, spec.scale, state, export_offsets=export_offsets,
                precision=_precision(pre.dtype),
            )  # fmt: skip
        exported = self._exports(pre, cu_seqlens, prior, export_offsets, conv.shape[-1], states_at)
        return gated_rms_norm(o, norm, gate, spec.eps, pre.dtype), tail, state, exported
