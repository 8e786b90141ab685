"""`select_ops(device, dtype)`: the op backend of a model, decided once when it is prepared.

bf16 models on CPU get `CpuNativeOps` when the native library builds and loads (`kernels.cpu`);
everything else, and every model when `DELTASERVE_NATIVE=0`, gets the reference `TorchOps`.
The native paths apply only to bf16 operands, so an fp32 model on the native backend would run
the reference everywhere anyway.

`DELTASERVE_DECODE_STACK=0` keeps the native backend's decode steps layer by layer (block plans,
no whole-stack plan), `DELTASERVE_FLASH_PREFILL=0` its MLA prefill attention on SDPA (the reference's
rounding) instead of the native flash kernel; both for side-by-side comparisons.

CUDA models get `TritonOps` (`ops.backends.triton`, imported only then) when `triton` is importable.
`DELTASERVE_TRITON=0` never picks it; `DELTASERVE_TRITON=1` picks it on any device (on CPU the
kernels then need `TRITON_INTERPRET=1`: how they are tested without a GPU), and fails loudly
where it cannot run.
"""

from __future__ import annotations

import torch

from ... import env
from ...kernels import triton as triton_backend
from ...kernels.cpu import native
from ..operands import ServedShapes
from .cpu import CpuNativeOps
from .torch import REFERENCE, TorchOps


def _wants_triton(device: torch.device) -> bool:
    flag = env.TRITON.get()
    if flag in ("0", "1"):
        return flag == "1"
    return device.type == "cuda" and triton_backend.available()


def triton_ops(device: torch.device | str) -> TorchOps:
    """A `TritonOps` for models on `device`. RuntimeError where its kernels cannot run there:
    triton missing, or a non-CUDA device without the interpreter."""
    device = torch.device(device)
    if not triton_backend.available():
        raise RuntimeError("the Triton backend needs `triton` (pip install 'deltaserve[gpu]')")
    if device.type != "cuda" and not triton_backend.interpreted():
        raise RuntimeError(f"Triton kernels run on CUDA, or on {device.type} only with TRITON_INTERPRET=1")
    from .triton import TritonOps

    return TritonOps()


def select_ops(device: torch.device | str, dtype: torch.dtype, fuse_blocks: bool = True) -> TorchOps:
    """The backend for a model whose weights live on `device` in `dtype`."""
    device = torch.device(device)
    if _wants_triton(device):
        return triton_ops(device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        kernels = native(device)
        if kernels is not None:
            stack = env.DECODE_STACK.on()
            flash = env.FLASH_PREFILL.on()
            return CpuNativeOps(kernels, fuse_blocks=fuse_blocks, fuse_stack=stack, flash_prefill=flash)
    return REFERENCE


def describe(ops: TorchOps, served: ServedShapes | None = None) -> str:
    """One line naming the implementation of each op family (grouped when they agree): what runs
    for a model of `served`'s dtypes and shapes (`TorchOps.describe`)."""
    by_impl: dict[str, list[str]] = {}
    for family, impl in ops.describe(served).items():
        by_impl.setdefault(impl, []).append(family)
    return "; ".join(f"{impl}: {', '.join(families)}" for impl, families in by_impl.items())
