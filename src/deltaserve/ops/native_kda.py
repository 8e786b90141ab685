"""ctypes bindings of the native chunked-KDA prefill kernels (see `ops.cpu_kernels`)."""
from __future__ import annotations

import ctypes


class KdaPrefillBindings:
    """Mixin of `NativeKernels`; `declare(lib)` sets the ctypes signatures it calls."""

    lib: ctypes.CDLL

    @staticmethod
    def declare(lib: ctypes.CDLL) -> None:
        pass
