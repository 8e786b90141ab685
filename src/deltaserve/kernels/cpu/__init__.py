"""Native CPU kernels: `csrc/*.c` behind one declared ABI (`csrc/ds_abi.h`, parsed by `abi.py`),
compiled by `build.py`, loaded and checked by `library.py`, bound by concern (`decode.py`,
`prefill.py`, `kda.py`, `blocks.py`). `native()` returns the kernels or None (the PyTorch path)."""

from .library import (
    ACT_SILU,
    ACT_SITU,
    AMX_ROWS,
    GATE_SIGMOID,
    GATE_SOFTPLUS,
    GROUP_SIZE,
    MAX_MIX,
    MAX_MULTI,
    MAX_ROWS,
    MLA_MAX_HEADS,
    MLA_MAX_RANK,
    NativeKernels,
    is_loaded,
    native,
    set_enabled,
)

__all__ = [
    "ACT_SILU",
    "ACT_SITU",
    "AMX_ROWS",
    "GATE_SIGMOID",
    "GATE_SOFTPLUS",
    "GROUP_SIZE",
    "MAX_MIX",
    "MAX_MULTI",
    "MAX_ROWS",
    "MLA_MAX_HEADS",
    "MLA_MAX_RANK",
    "NativeKernels",
    "is_loaded",
    "native",
    "set_enabled",
]
