"""Optional Triton GPU kernels, imported lazily: importing this package (or deltaserve) never
imports `triton`; only `triton_ops()` and the submodules do.

`TritonOps` (in `.backend`) runs on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1`
(how the kernels are tested without a GPU). fla-core's KDA kernels (`fla.ops.kda`) are used
where they import and fit (`.fla`); ours everywhere else.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch


def available() -> bool:
    """Whether `triton` is importable (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def optional_import(module: str, attr: str, switch: str):
    """`module.attr` where it imports and the environment variable `switch` is not "0" (the
    optional libraries: fla-core, torch's flash varlen); None otherwise."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def interpreted() -> bool:
    """Whether Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_ops(device: torch.device | str):
    """A `TritonOps` for models on `device`. RuntimeError where its kernels cannot run there:
    triton missing, or a non-CUDA device without the interpreter."""
    device = torch.device(device)
    if not available():
        raise RuntimeError("the Triton backend needs `triton` (pip install 'deltaserve[gpu]')")
    if device.type != "cuda" and not interpreted():
        raise RuntimeError(f"Triton kernels run on CUDA, or on {device.type} only with TRITON_INTERPRET=1")
    from .backend import TritonOps

    return TritonOps()


__all__ = ["available", "interpreted", "optional_import", "triton_ops"]
