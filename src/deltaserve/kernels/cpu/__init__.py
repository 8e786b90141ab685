"""Native CPU kernels: `csrc/*.c` behind one declared ABI (`csrc/ds_abi.h`, parsed by `abi.py`),
compiled per ISA by `build.py`, loaded and checked by `library.py`, bound by concern (`decode.py`,
`attention.py`, `prefill.py`, `kda.py`, `blocks.py`). `native()` returns the kernels or None (the
PyTorch path). This package exports exactly what `library.py` exports."""

from .library import *  # noqa: F403
from .library import __all__  # noqa: F401
