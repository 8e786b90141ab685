"""Compiling `csrc/*.c` (with `csrc/*.h`, the ABI header among them) into one shared library under
`~/.cache/deltaserve/native/` (`$DELTASERVE_CACHE/native`).

A build is keyed by the sources and headers, the compiler's version, the flags and the CPU's
feature flags; it is written to a temporary file and renamed into place under a file lock, so
concurrent processes never load a half-written library, and a later process with the same key
loads the cached one without compiling.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CSRC", "build", "find_compiler"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(CSRC.glob("*.c"))
_HEADERS = sorted(CSRC.glob("*.h"))
_FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
    "-Wall",
    "-Werror=implicit-function-declaration",
    "-Werror=implicit-int",
]
_LIBS = ["-lm"]


def find_compiler() -> str | None:
    """`$CC`, else `cc` or `gcc` on PATH, else None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


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


def build(compiler: str) -> Path:
    """The library for this source, compiler and CPU, compiled if not cached yet. Raises OSError or
    subprocess.CalledProcessError (its stderr holds the compiler's messages)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join([*(f.read_text() for f in _SOURCES + _HEADERS), version, " ".join(_FLAGS), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"cpu_kernels-{key}.so"
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            log.info("compiling the native CPU kernels into %s (once per source, compiler and CPU)", lib)
            fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
            os.close(fd)
            try:
                subprocess.run(
                    [compiler, *_FLAGS, *map(str, _SOURCES), "-o", tmp, *_LIBS],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return lib
