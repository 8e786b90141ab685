"""ctypes bindings of the prefill-oriented native kernels (large-M activations and expert
combination, the chunked KDA prefill, the causal conv): each method checks dtypes, shapes and
contiguity, then calls `self.lib` (see `ops.cpu_kernels`)."""
from __future__ import annotations

import ctypes

import torch

from .native_abi import I as _I, L as _L, P as _P


class PrefillBindings:
    """Mixin of `NativeKernels`; `declare(lib)` sets the ctypes signatures it calls."""

    lib: ctypes.CDLL

    @staticmethod
    def declare(lib: ctypes.CDLL) -> None:
        pass
