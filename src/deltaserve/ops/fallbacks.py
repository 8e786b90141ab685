"""Per-call fallbacks of the op backends: counted by (op, reason) and logged once per pair.

A fallback is a call where a backend's kernel for an op does not run and the PyTorch reference
(or, for a `*_decode` method that declines, the layer's module-by-module path, its `otherwise`) runs instead:
operands outside the kernel's dtype or shape window, a cache pool of another dtype, a CPU without
the instruction set. A backend's designed dispatch between its own kernels (GEMV, tiles, oneDNN
GEMMs by batch size; a whole-block or whole-stack plan declined for the per-layer kernels) and
empty inputs are not fallbacks. Each fallback site calls `fallback(op, reason)` once.

The counts are process-wide (every engine of the process adds to them; under tensor or data
parallelism each rank process has its own) and only grow. The engine reports them in
`stats()["kernel_fallbacks"]`; the server exports them as `deltaserve:kernel_fallbacks_total`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("deltaserve.ops")

REASONS = {
    "dtype": "activations or weights of a dtype the kernel does not take",
    "cache_dtype": "a cache pool (MLA rows, KDA conv tails or states) of a dtype the kernel does not take",
    "shape": "a model shape outside the kernel's window (heads, ranks, widths, expert groups)",
    "rows": "more rows in the call than the kernel takes",
    "layout": "operands not laid out as the kernel reads them (strides, no page table)",
    "device": "tensors on a device the kernel does not run on",
    "isa": "a CPU without the instruction set the kernel needs",
    "variant": "an op variant the backend has no kernel for",
    "unprepared": "no plan prepared for the kernel at load (a module the backend's prepare_* did not see)",
    "disabled": "the kernel switched off by its environment variable",
}

EXPECTED = ("rows", "variant", "disabled")  # stated in the start-up line: logged at INFO, the rest WARNING
_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()


def fallback(op: str, reason: str) -> None:
    """Count one fallback of `op` (the op seam's method name) for `reason` (a key of REASONS); the
    first of each pair in the process is logged (WARNING, or INFO for the EXPECTED reasons)."""
    key = (op, reason)
    with _lock:
        first = key not in _counts
        _counts[key] += 1
    if first:
        log.log(
            logging.INFO if reason in EXPECTED else logging.WARNING,
            "op %s runs its fallback path (%s: %s); counted in deltaserve:kernel_fallbacks_total",
            op,
            reason,
            REASONS.get(reason, reason),
        )


def snapshot() -> dict[tuple[str, str], int]:
    """{(op, reason): calls} so far in this process."""
    with _lock:
        return dict(_counts)


def since(before: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    """The fallbacks counted after `before` (a `snapshot`), zero pairs left out."""
    now = snapshot()
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


def table() -> dict[str, dict[str, int]]:
    """{op: {reason: calls}} so far in this process (plain keys: it crosses process links)."""
    out: dict[str, dict[str, int]] = {}
    for (op, reason), n in sorted(snapshot().items()):
        out.setdefault(op, {})[reason] = n
    return out
