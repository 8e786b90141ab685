"""ctypes bindings of the native KDA prefill kernels: the chunked gated delta rule and the causal
conv (+ optional per-head L2 norm) of `csrc/kda_chunk.c` with the semantics of `ops.kda.kda_chunked` /
`causal_conv1d`, and the decay and output norm of `csrc/small_ops.c` (`ops.kda.kda_gate_sigmoid`,
`ops.norms.gated_rms_norm`); each method checks dtypes, shapes and strides, then
calls `self.lib` (see `library.py`)."""

from __future__ import annotations

import ctypes

import torch

from ..chunking import checked_cu_seqlens, chunk_plan
from .abi import KDA_MAX_CHUNK


def _heads_rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """`t` [N, H, d] fp32 with heads and channels contiguous (any token stride), copying if not."""
    if (t.stride(-1) == 1 or d == 1) and (t.stride(1) == d or t.shape[1] == 1):
        return t
    return t.contiguous()


def _prefix(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).contiguous()


class KdaPrefillBindings:
    """Mixin of `NativeKernels` (`self.lib`: the library, its signatures declared from ds_abi.h)."""

    lib: ctypes.CDLL

    def kda_gate_sigmoid(
        self, f: torch.Tensor, a_log_f32: torch.Tensor, dt_bias_f32: torch.Tensor, lower_bound: float
    ) -> torch.Tensor:
        """`ops.kda.kda_gate_sigmoid` for bf16 f [N, H, K] (token rows may be strided) with fp32
        A_log [H] and dt_bias [H*K]. Returns fp32 [N, H, K]."""
        n, h, dk = f.shape
        if not (
            f.dtype == torch.bfloat16
            and a_log_f32.dtype == dt_bias_f32.dtype == torch.float32
            and a_log_f32.numel() == h
            and dt_bias_f32.numel() == h * dk
        ):
            raise ValueError("kda_gate_sigmoid: operand shapes or dtypes disagree")
        if not (f.stride(2) == 1 and f.stride(1) == dk):
            f = f.contiguous()
        g = torch.empty(n, h, dk)
        self.lib.ds_kda_gate_sigmoid(
            f.data_ptr(),
            f.stride(0),
            n,
            h,
            dk,
            a_log_f32.contiguous().data_ptr(),
            dt_bias_f32.contiguous().data_ptr(),
            lower_bound,
            g.data_ptr(),
            torch.get_num_threads(),
        )
        return g

    def gated_rms_norm(self, o: torch.Tensor, weight_f32: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
        """`ops.norms.gated_rms_norm(o, weight, gate, eps, bf16)` for fp32 o [N, H, K] and bf16 gate
        [N, H, K] (token rows may be strided). Returns bf16 [N, H, K]."""
        n, h, dk = o.shape
        if not (
            o.dtype == weight_f32.dtype == torch.float32
            and gate.dtype == torch.bfloat16
            and tuple(gate.shape) == (n, h, dk)
            and weight_f32.numel() == dk
        ):
            raise ValueError("gated_rms_norm: operand shapes or dtypes disagree")
        o = o.contiguous()
        if not (gate.stride(2) == 1 and gate.stride(1) == dk):
            gate = gate.contiguous()
        out = torch.empty(n, h, dk, dtype=torch.bfloat16)
        self.lib.ds_gated_rms_norm(
            o.data_ptr(),
            n,
            h,
            dk,
            weight_f32.contiguous().data_ptr(),
            gate.data_ptr(),
            gate.stride(0),
            eps,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def kda_chunked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
        initial_state: torch.Tensor | None = None,
        chunk_size: int = 64,
        export_offsets: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`ops.kda.kda_chunked` in one native call (fp32 inputs; q, k, g, v may have any token
        stride). Same shapes, returns and export semantics."""
        n, h, dk = k.shape
        dv = v.shape[-1]
        if not (
            all(t.dtype == torch.float32 for t in (q, k, v, g, beta))
            and tuple(q.shape) == tuple(g.shape) == (n, h, dk)
            and tuple(v.shape[:2]) == (n, h)
            and v.dim() == 3
            and tuple(beta.shape) == (n, h)
            and 1 <= chunk_size <= KDA_MAX_CHUNK
        ):
            raise ValueError("kda_chunked: operand shapes or dtypes disagree")
        cu = checked_cu_seqlens(cu_seqlens, n)
        nseq = cu.numel() - 1
        start, length, _, _, n_chunks, ex_chunk = chunk_plan(cu, export_offsets, chunk_size)
        q, k, g, v = _heads_rows(q, dk), _heads_rows(k, dk), _heads_rows(g, dk), _heads_rows(v, dv)
        if not (beta.stride(-1) == 1 or h == 1):
            beta = beta.contiguous()
        s0 = None
        if initial_state is not None:
            if tuple(initial_state.shape) != (nseq, h, dk, dv):
                raise ValueError("kda_chunked: initial_state must be [B, H, K, V]")
            s0 = initial_state.to(torch.float32).contiguous()
        o = torch.empty(n, h, dv)
        final = torch.empty(nseq, h, dk, dv)
        exported = ex_first = None
        if export_offsets is not None:
            ex_first = _prefix(torch.tensor([len(e) for e in export_offsets], dtype=torch.long))
            exported = torch.empty(int(ex_first[-1]), h, dk, dv)
            ex_chunk = ex_chunk.contiguous()
        first = _prefix(n_chunks)
        rc = self.lib.ds_kda_chunked(
            nseq,
            h,
            dk,
            dv,
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            g.data_ptr(),
            g.stride(0),
            beta.data_ptr(),
            beta.stride(0),
            scale,
            first.data_ptr(),
            start.contiguous().data_ptr(),
            length.contiguous().data_ptr(),
            None if ex_first is None else ex_first.data_ptr(),
            None if ex_first is None else ex_chunk.data_ptr(),
            None if s0 is None else s0.data_ptr(),
            o.data_ptr(),
            final.data_ptr(),
            None if exported is None else exported.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -1:
            raise MemoryError("kda_chunked: scratch allocation failed")
        if rc != 0:
            raise ValueError("kda_chunked: bad sizes or chunk plan")
        return o, final, exported

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        cu_seqlens: torch.Tensor,
        initial_tail: torch.Tensor | None = None,
        l2_groups: int = 0,
        group: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`ops.kda.causal_conv1d` for bf16 x [N, C] (rows may be strided) and fp32 weight [C, W];
        initial_tail [B, W-1, C] bf16 or None. With `l2_groups`, channels [0, l2_groups*group)
        of y are then L2-normalised per group of `group` (`ops.kda.l2_norm`, eps 1e-6).
        Returns (y fp32 [N, C], final_tail bf16 [B, W-1, C])."""
        n, c = x.shape
        w = weight.shape[-1]
        weight = weight.reshape(-1, w)
        if not (
            x.dtype == torch.bfloat16
            and weight.dtype == torch.float32
            and weight.shape[0] == c
            and w >= 1
            and l2_groups >= 0
            and group >= 1
            and l2_groups * group <= c
        ):
            raise ValueError("causal_conv1d: operand shapes or dtypes disagree")
        if not (x.stride(1) == 1 or c == 1):
            x = x.contiguous()
        cu = checked_cu_seqlens(cu_seqlens, n).contiguous()
        nseq = cu.numel() - 1
        if initial_tail is not None:
            if initial_tail.dtype != torch.bfloat16 or tuple(initial_tail.shape) != (nseq, w - 1, c):
                raise ValueError("causal_conv1d: initial_tail must be bf16 [B, W-1, C]")
            initial_tail = initial_tail.contiguous()
        weight = weight.contiguous()
        y = torch.empty(n, c)
        tail = torch.empty(nseq, w - 1, c, dtype=torch.bfloat16)
        rc = self.lib.ds_causal_conv1d(
            n,
            c,
            w,
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            nseq,
            cu.data_ptr(),
            None if initial_tail is None else initial_tail.data_ptr(),
            l2_groups,
            group,
            y.data_ptr(),
            tail.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -1:
            raise MemoryError("causal_conv1d: allocation failed")
        if rc != 0:
            raise ValueError("causal_conv1d: bad sizes")
        return y, tail
