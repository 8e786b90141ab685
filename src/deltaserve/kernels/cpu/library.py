"""The native CPU kernels, loaded: `native()` hands out the process's `NativeKernels` (the library
built by `build.py` from `csrc/*.c`, with every binding), or None.

`ops.select.select_ops` asks once per model, when it is prepared after loading, and binds the
native backend (`ops.cpu_native`) or the pure-PyTorch reference; nothing asks per call. None
means: no compiler, a failed build, a library that fails the ABI check of `abi.py`, a non-CPU
device, `set_enabled(False)` or `DELTASERVE_NATIVE=0`; a missing compiler, a failed build or a
refused library is logged as a warning, once per process. `is_loaded()` says whether the build
has happened (the engine's start-up does it, so it never lands on a request).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
import time

import torch

from .abi import (
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
    AbiMismatch,
    check,
    declare,
)
from .attention import AttentionDecodeBindings
from .blocks import BlockBindings
from .build import build as _build
from .build import find_compiler
from .decode import DecodeBindings
from .kda import KdaPrefillBindings
from .prefill import PrefillBindings

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

log = logging.getLogger(__name__)


class NativeKernels(DecodeBindings, AttentionDecodeBindings, PrefillBindings, KdaPrefillBindings, BlockBindings):
    """The loaded library with every binding; `native()` hands out the process's instance."""

    def __init__(self, lib: ctypes.CDLL):
        """Declares every `ds_abi.h` function on `lib` and checks its ABI (AbiMismatch) before any call."""
        self.lib = lib
        declare(lib)
        check(lib)
        lib.ds_init()
        self.avx512_bf16 = bool(lib.ds_has_avx512bf16())
        self.amx = False
        self.set_amx(os.environ.get("DELTASERVE_AMX", "1") != "0")

    def set_amx(self, flag: bool) -> bool:
        """Use AMX tiles (where the CPU and kernel allow them) for batched decode; returns the old value."""
        old = self.amx
        self.lib.ds_amx_set_enabled(int(flag))
        self.amx = bool(self.lib.ds_amx_ready())
        return old

    def amx_uses(self) -> int:
        """Kernel calls and expert chunks that ran on AMX tiles in this process (tests check engagement)."""
        return int(self.lib.ds_amx_uses())


@functools.lru_cache(maxsize=1)
def _load() -> NativeKernels | None:
    if os.environ.get("DELTASERVE_NATIVE", "1") == "0":
        return None
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found: native CPU kernels disabled, using the PyTorch paths")
        return None
    start = time.perf_counter()
    try:
        lib = _build(compiler)
        kernels = NativeKernels(ctypes.CDLL(str(lib)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("native CPU kernels unavailable (%s); using the PyTorch paths", detail.strip()[:500])
        return None
    except AbiMismatch as err:
        log.warning(
            "native CPU kernels refused: %s is not the library ds_abi.h declares (%s); using the PyTorch paths",
            lib,
            err,
        )
        return None
    log.info(
        "native CPU kernels ready in %.1f s from %s (AVX512-BF16: %s, AMX: %s)",
        time.perf_counter() - start,
        lib,
        kernels.avx512_bf16,
        kernels.amx,
    )
    return kernels


def is_loaded() -> bool:
    """True once this process has built/loaded the library (or found it unavailable): from then
    on `native()` never compiles."""
    return _load.cache_info().currsize > 0


_enabled = True


def set_enabled(flag: bool) -> bool:
    """Let `native()` hand out the kernels or not (for models prepared from now on: tests compare
    both backends); returns the old value."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


def native(device: torch.device | str = "cpu") -> NativeKernels | None:
    """The kernels for tensors on `device`, or None where only the PyTorch path applies."""
    if not _enabled:
        return None
    if device == "cpu" or getattr(device, "type", None) == "cpu":  # the per-call path: no device object
        return _load()
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _load() if kind == "cpu" else None
