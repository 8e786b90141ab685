"""Compiling `csrc/*.c` (with `csrc/*.h`, the ABI header among them) into one shared library under
`~/.cache/deltaserve/native/` (`$DELTASERVE_CACHE/native`).

One library per instruction set (`choose_isa`: `$DELTASERVE_ISA` = `avx2`, `avx512` or `amx`,
unset = the best the CPU has; one it lacks is refused with a warning): `amx` is `-march=native`
with AMX tiles, `avx512` the same without AMX (the AVX512-BF16 kernels), `avx2` `-march=x86-64-v3`
(no AVX-512: the GEMV and expert row kernels in AVX2 + FMA, csrc/avx2.h, the rest portable C); a CPU
without AVX2 gets `generic` (`-march=native`). A build is keyed by the sources and headers, the
compiler's version, the flags (the ISA's among them) and the CPU's feature flags; it is written to a
temporary file and renamed into place under a file lock, so concurrent processes never load a
half-written library, and a later process with the same key loads the cached one without compiling.
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

from ... import env

__all__ = ["CSRC", "ISAS", "build", "choose_isa", "cpu_isas", "find_compiler", "isa_flags"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
_FLAGS = [
    "-O3",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
    "-Wall",
    "-Werror=implicit-function-declaration",
    "-Werror=implicit-int",
]
_LIBS = ["-lm"]
ISAS = ("avx2", "avx512", "amx")  # lowest first; each needs the CPU flags of those below it too
_NEEDS = {
    "avx2": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"},  # x86-64-v3 (abm: LZCNT)
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16"},
}
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]


def find_compiler() -> str | None:
    """`$CC`, else `cc` or `gcc` on PATH, else None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    root = env.CACHE.get() or Path.home() / ".cache" / "deltaserve"
    return Path(root) / "native"


def _cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cpu_isas() -> tuple[str, ...]:
    """The ISAS this CPU runs, lowest first (empty off x86 or below AVX2)."""
    have, out = set(_cpu_flags().split()), []
    for isa in ISAS:
        if not _NEEDS[isa] <= have:
            break
        out.append(isa)
    return tuple(out)


def choose_isa(requested: str | None = None) -> str:
    """`requested` (one of ISAS; None or "" = the best the CPU has) where the CPU runs it, else the
    best it has below that, with a warning; `generic` where it has none of them."""
    have = cpu_isas()
    best = have[-1] if have else "generic"
    if not requested:
        return best
    if requested not in ISAS:
        log.warning("DELTASERVE_ISA=%s is not one of %s: using %s", requested, "|".join(ISAS), best)
        return best
    if requested not in have:
        lower = [i for i in have if ISAS.index(i) < ISAS.index(requested)]
        chosen = lower[-1] if lower else "generic"
        log.warning("DELTASERVE_ISA=%s refused: this CPU lacks %s; using %s", requested, requested, chosen)
        return chosen
    return requested


def isa_flags(isa: str) -> list[str]:
    """The compiler's target flags for `isa` (one of ISAS or `generic`)."""
    if isa == "avx2":
        return ["-march=x86-64-v3", "-mtune=native"]
    wide = ["-march=native", "-mprefer-vector-width=512"] if isa in ("avx512", "amx") else ["-march=native"]
    return wide + _NO_AMX if isa == "avx512" and "amx" in cpu_isas() else wide


def build(compiler: str, isa: str, csrc: Path = CSRC) -> Path:
    """The library for the sources in `csrc` (this package's, or another revision's for side-by-side
    measurements), compiler, CPU and `isa` (as `isa_flags` takes it), compiled if not cached yet.
    Raises OSError or subprocess.CalledProcessError (its stderr holds the compiler's messages)."""
    sources, headers = sorted(Path(csrc).glob("*.c")), sorted(Path(csrc).glob("*.h"))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = [*isa_flags(isa), *_FLAGS]
    key = hashlib.sha256(
        "\0".join([*(f.read_text() for f in sources + headers), version, " ".join(flags), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"cpu_kernels-{isa}-{key}.so"
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            log.info("compiling the native CPU kernels (%s) into %s (once per source, compiler and CPU)", isa, lib)
            fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
            os.close(fd)
            try:
                subprocess.run(
                    [compiler, *flags, *map(str, sources), "-o", tmp, *_LIBS],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return lib
