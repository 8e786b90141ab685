"""Optional native CPU kernels (`csrc/*.c`), compiled on first use with the system C compiler
(`-O3 -march=native -fopenmp`) into one library under `~/.cache/deltaserve/native/` and called
through ctypes on tensor data pointers.

The pure-PyTorch ops stay the default and the oracle: callers use `native()` and fall back when
it returns None (no compiler, a failed build, a non-CPU device, or `DELTASERVE_NATIVE=0`).
Builds are keyed by the source, the compiler and the CPU's feature flags, written atomically
and serialised with a file lock, so concurrent processes never load a half-written library.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .native_abi import ACT_SILU, ACT_SITU, AMX_ROWS, GATE_SIGMOID, GATE_SOFTPLUS, GROUP_SIZE, MAX_ROWS, \
    MLA_MAX_HEADS, MLA_MAX_RANK
from .native_blocks import BlockBindings
from .native_decode import DecodeBindings
from .native_kda import KdaPrefillBindings
from .native_prefill import PrefillBindings

__all__ = ["ACT_SILU", "ACT_SITU", "AMX_ROWS", "GATE_SIGMOID", "GATE_SOFTPLUS", "GROUP_SIZE", "MAX_ROWS", "MLA_MAX_HEADS",
           "MLA_MAX_RANK", "NativeKernels", "native", "set_enabled"]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.c"))
_HEADERS = sorted(_CSRC.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-Wall",
          "-Werror=implicit-function-declaration", "-Werror=implicit-int"]
_LIBS = ["-lm"]


def _cache_dir() -> Path:
    root = os.environ.get("DELTASERVE_CACHE") or Path.home() / ".cache" / "deltaserve"
    return Path(root) / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in _SOURCES + _HEADERS), version, " ".join(_FLAGS), _cpu_flags()])
                         .encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"cpu_kernels-{key}.so"
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
            os.close(fd)
            try:
                subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", tmp, *_LIBS], capture_output=True,
                               text=True, check=True)
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            log.info("compiled native CPU kernels into %s", lib)
    return lib


class NativeKernels(DecodeBindings, PrefillBindings, KdaPrefillBindings, BlockBindings):
    """The loaded library with every binding; `native()` hands out the process's instance."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.ds_init.restype = None
        lib.ds_init()
        DecodeBindings.declare(lib)
        PrefillBindings.declare(lib)
        KdaPrefillBindings.declare(lib)
        BlockBindings.declare(lib)
        self.avx512_bf16 = bool(lib.ds_has_avx512bf16())
        lib.ds_amx_ready.restype = ctypes.c_int
        lib.ds_amx_set_enabled.argtypes = [ctypes.c_int]
        lib.ds_amx_set_enabled.restype = None
        lib.ds_amx_uses.restype = ctypes.c_int64
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
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: native CPU kernels disabled, using the PyTorch paths")
        return None
    try:
        kernels = NativeKernels(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        log.warning("native CPU kernels unavailable (%s); using the PyTorch paths", detail.strip()[:500])
        return None
    log.info("native CPU kernels loaded (AVX512-BF16: %s, AMX: %s)", kernels.avx512_bf16, kernels.amx)
    return kernels


_enabled = True


def set_enabled(flag: bool) -> bool:
    """Turn the native paths on or off process-wide (tests compare both); returns the old value."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


def native(device: torch.device | str = "cpu") -> NativeKernels | None:
    """The kernels for tensors on `device`, or None where only the PyTorch path applies."""
    if not _enabled:
        return None
    if device == "cpu" or getattr(device, "type", None) == "cpu":   # the per-call path: no device object
        return _load()
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _load() if kind == "cpu" else None
