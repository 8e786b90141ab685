"""`select_ops(device, dtype)`: the op backend of a model, decided once when it is prepared.

bf16 models on CPU get `CpuNativeOps` when the native library builds and loads (`kernels.cpu`);
everything else, and every model when `DELTASERVE_NATIVE=0`, gets the reference `TorchOps`.
The native paths apply only to bf16 operands, so an fp32 model on the native backend would run
the reference everywhere anyway. A CUDA backend (Triton kernels) will be chosen here.
"""

from __future__ import annotations

import torch

from ..kernels.cpu import native
from .backend import REFERENCE, TorchOps
from .cpu_native import CpuNativeOps


def select_ops(device: torch.device | str, dtype: torch.dtype, fuse_blocks: bool = True) -> TorchOps:
    """The backend for a model whose weights live on `device` in `dtype`."""
    device = torch.device(device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        kernels = native(device)
        if kernels is not None:
            return CpuNativeOps(kernels, fuse_blocks=fuse_blocks)
    return REFERENCE


def describe(ops: TorchOps) -> str:
    """One line naming the implementation of each op family (grouped when they agree)."""
    by_impl: dict[str, list[str]] = {}
    for family, impl in ops.describe().items():
        by_impl.setdefault(impl, []).append(family)
    return "; ".join(f"{impl}: {', '.join(families)}" for impl, families in by_impl.items())
