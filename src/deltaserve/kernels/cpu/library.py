"""The native CPU kernels, loaded: `native()` hands out the process's `NativeKernels` (the library
built by `build.py` from `csrc/*.c` for the ISA `$DELTASERVE_ISA` names or the best the CPU has,
with every binding), or None; `load(isa)` builds and loads one ISA's variant on its own (tests).

`ops.backends.select.select_ops` asks once per model, when it is prepared after loading, and binds the
native backend (`ops.backends.cpu`) or the pure-PyTorch reference; nothing asks per call. None
means: no compiler, a failed build, a library that fails the ABI check of `abi.py`, a non-CPU
device, `set_enabled(False)` or `DELTASERVE_NATIVE=0`; a missing compiler, a failed build or a
refused library is logged as a warning, once per process. `is_loaded()` says whether the build
has happened (the engine's start-up does it, so it never lands on a request).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import subprocess
import time
from pathlib import Path

import torch

from ... import env
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
from .build import CSRC, choose_isa, find_compiler
from .build import build as _build
from .decode import DecodeBindings
from .kda import KdaPrefillBindings
from .prefill import PrefillBindings
from .stack import StackBindings

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
    "load",
    "native",
    "set_enabled",
    "using",
]

log = logging.getLogger(__name__)


class NativeKernels(
    DecodeBindings, AttentionDecodeBindings, PrefillBindings, KdaPrefillBindings, BlockBindings, StackBindings
):
    """The loaded library with every binding; `native()` hands out the process's instance."""

    def __init__(self, lib: ctypes.CDLL, built_for: str = "avx2"):
        """Declares every `ds_abi.h` function on `lib` and checks its ABI (AbiMismatch) before any
        call. `isa` is what runs, fixed here: `built_for` (`build.choose_isa`) lowered to what the
        library reports (`amx` without tiles granted or with `DELTASERVE_AMX=0` runs `avx512`)."""
        self.lib = lib
        declare(lib)
        check(lib)
        lib.ds_init()
        self.avx512_bf16 = bool(lib.ds_has_avx512bf16())
        self.amx = self.tiles = False
        self.set_amx(env.AMX.on())
        lowest = "generic" if built_for == "generic" else "avx2"
        self.isa = "amx" if self.amx else ("avx512" if self.avx512_bf16 else lowest)
        if self.isa != built_for:
            log.info("native CPU kernels built for %s run %s", built_for, self.isa)

    def set_amx(self, flag: bool) -> bool:
        """Use AMX tiles (where the CPU and kernel allow them) for batched decode; returns the old value.
        Without them the tile kernels run on AVX512-BF16 registers where the build has those (`tiles`)."""
        old = self.amx
        self.lib.ds_amx_set_enabled(int(flag))
        self.amx = bool(self.lib.ds_amx_ready())
        self.tiles = bool(self.lib.ds_tiles_ready())
        return old

    def set_tiles(self, flag: bool) -> bool:
        """Use the AVX512-BF16 register tiles where AMX does not run (off: batched decode above MAX_ROWS
        rows goes to torch GEMMs, experts to the GEMV kernels); returns the old value."""
        old, self._reg_tiles = getattr(self, "_reg_tiles", True), bool(flag)
        self.lib.ds_tiles_set_enabled(int(flag))
        self.tiles = bool(self.lib.ds_tiles_ready())
        return old

    @property
    def tile_kind(self) -> str:
        """What runs the tile kernels (batched decode of 9..AMX_ROWS rows, fused experts at any batch):
        `amx`, `avx512-bf16` (register tiles) or `none`."""
        return ("none", "avx512-bf16", "amx")[int(self.lib.ds_tiles_ready())]

    def amx_uses(self) -> int:
        """Kernel calls and expert m-blocks (16 pairs) that ran on AMX tiles in this process (tests check
        engagement)."""
        return int(self.lib.ds_amx_uses())

    def tile_uses(self) -> int:
        """Kernel calls and expert m-blocks that ran on either kind of tile in this process."""
        return int(self.lib.ds_tiles_uses())


def load(isa: str | None = None, compiler: str | None = None, csrc: Path | None = None) -> NativeKernels:
    """The library for `isa` (`build.choose_isa`: None = `$DELTASERVE_ISA`, else the best the CPU
    has) from the sources in `csrc` (None: this package's), built if not cached, with its own
    bindings (the same file as `native()`'s shares that library's state). Raises OSError (no
    compiler, or the loader's), subprocess.CalledProcessError (a failed build) or AbiMismatch."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise OSError("no C compiler found")
    chosen = choose_isa(env.ISA.get() if isa is None else isa)
    path = _build(compiler, chosen, csrc or CSRC)
    try:
        return NativeKernels(ctypes.CDLL(str(path)), chosen)
    except AbiMismatch as err:
        raise AbiMismatch(f"{path} is not the library ds_abi.h declares ({err})") from err


@functools.lru_cache(maxsize=1)
def _load() -> NativeKernels | None:
    if not env.NATIVE.on():
        return None
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found: native CPU kernels disabled, using the PyTorch paths")
        return None
    start = time.perf_counter()
    try:
        kernels = load(compiler=compiler)
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("native CPU kernels unavailable (%s); using the PyTorch paths", detail.strip()[:500])
        return None
    except AbiMismatch as err:
        log.warning("native CPU kernels refused: %s; using the PyTorch paths", err)
        return None
    log.info(
        "native CPU kernels (%s, tiles: %s) ready in %.1f s from %s",
        kernels.isa,
        kernels.tile_kind,
        time.perf_counter() - start,
        kernels.lib._name,
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


_chosen: NativeKernels | None = None  # `using`'s kernels, else None: the process's own build


@contextlib.contextmanager
def using(kernels: NativeKernels):
    """`native()` hands out `kernels` inside the block: two builds measured side by side in one
    process (scripts/native_ab.py), each engine built and run inside its own block."""
    global _chosen
    old, _chosen = _chosen, kernels
    try:
        yield kernels
    finally:
        _chosen = old


def native(device: torch.device | str = "cpu") -> NativeKernels | None:
    """The kernels for tensors on `device`, or None where only the PyTorch path applies."""
    if not _enabled:
        return None
    if device != "cpu" and getattr(device, "type", None) != "cpu":  # "cpu": the per-call path, no device object
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
        if kind != "cpu":
            return None
    return _chosen or _load()
