"""Our Triton GPU kernels, imported lazily: importing this package (or deltaserve) never
imports `triton`; only the submodules do. Each kernel is tested against the reference op of its
family (`ops/`), in the interpreter on CPU (`TRITON_INTERPRET=1`) or on CUDA.

`TritonOps` (`ops.backends.triton`) runs them on CUDA tensors, or on CPU tensors under
`TRITON_INTERPRET=1`; the adapters of other libraries' kernels are in `kernels.extern`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from ...env import Switch


def available() -> bool:
    """Whether `triton` is importable (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def optional_import(module: str, attr: str, switch: Switch):
    """`module.attr` where it imports and `switch` is on (the optional libraries: fla-core,
    torch's flash varlen); None otherwise."""
    if not switch.on():
        return None
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def interpreted() -> bool:
    """Whether Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = ["available", "interpreted", "optional_import"]
