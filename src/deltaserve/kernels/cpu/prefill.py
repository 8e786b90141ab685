"""ctypes bindings of the prefill-oriented native kernels (`csrc/moe_prefill.c`: GLU over rows of
GEMM outputs, the weighted combination of routed-expert outputs): each method checks dtypes,
shapes and strides, then calls `self.lib` (see `library.py`)."""

from __future__ import annotations

import ctypes

import torch


def _rows_ok(t: torch.Tensor, shape) -> bool:
    """bf16, 2-D of `shape`, columns contiguous (rows may be strided)."""
    return (
        t.dtype == torch.bfloat16
        and t.dim() == 2
        and tuple(t.shape) == tuple(shape)
        and (t.stride(1) == 1 or t.shape[1] <= 1)
    )


class PrefillBindings:
    """Mixin of `NativeKernels` (`self.lib`: the library, its signatures declared from ds_abi.h)."""

    lib: ctypes.CDLL

    def glu_rows(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        act: int,
        beta: float,
        linear_beta: float | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`situ_and_mul` / `silu_and_mul` of two bf16 [R, C] views whose rows may be strided
        (e.g. the halves of one [R, 2C] GEMM output), into `out` (or a new [R, C] tensor)."""
        rows, cols = gate.shape if gate.dim() == 2 else (-1, -1)
        out = torch.empty(rows, cols, dtype=torch.bfloat16) if out is None and rows >= 0 else out
        if rows < 0 or not (
            _rows_ok(gate, (rows, cols)) and _rows_ok(up, (rows, cols)) and _rows_ok(out, (rows, cols))
        ):
            raise ValueError("glu_rows: operands must be bf16 [R, C] with contiguous columns")
        if rows and cols:
            self.lib.ds_glu_rows_bf16(
                gate.data_ptr(),
                gate.stride(0),
                up.data_ptr(),
                up.stride(0),
                rows,
                cols,
                act,
                beta,
                linear_beta or 0.0,
                out.data_ptr(),
                out.stride(0),
                torch.get_num_threads(),
            )
        return out

    def moe_combine(self, ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`out[i] = bf16(sum_j weights[i, j] * ys[positions[i, j]])`, the fp32 sum over slots in
        order (`ops.moe.grouped_experts`' combination). ys [N*k, D] bf16 contiguous; positions int64
        and weights fp32 [N, k] (a permutation of 0..N*k-1). Returns [N, D] bf16."""
        n, k = weights.shape
        if not (
            ys.dtype == torch.bfloat16
            and ys.dim() == 2
            and ys.shape[0] == n * k
            and ys.is_contiguous()
            and tuple(positions.shape) == (n, k)
            and positions.dtype == torch.int64
        ):
            raise ValueError("moe_combine: operand shapes or dtypes disagree")
        positions = positions.contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(n, ys.shape[1], dtype=torch.bfloat16)
        if (
            n * k
            and self.lib.ds_moe_combine(
                ys.data_ptr(),
                positions.data_ptr(),
                weights.data_ptr(),
                n,
                k,
                ys.shape[1],
                out.data_ptr(),
                torch.get_num_threads(),
            )
            != 0
        ):
            raise ValueError("moe_combine: position out of range")
        return out
