"""Chained block hashes over match units of `u` tokens (DESIGN.md §3).

`h_k = sha256(h_{k-1} || tokens[(k-1)u : ku] as little-endian int64)`, with
`h_0 = sha256(namespace || model id || cache salt || extra keys)`. Two prefixes share `h_k` iff
they share the first k·u tokens (and the root keys), so a hash names an exact token boundary.

Per-unit extra keys (`spans`: `(start, end, key)` token ranges, e.g. an image's `<|media_pad|>`
positions and its content digest): a unit overlapping a span hashes that span's key after its
tokens, and every later unit inherits it through the chain. A unit overlapping no span hashes
exactly as without spans, so text-only chains are unchanged.
"""

from __future__ import annotations

import hashlib
import struct

_NAMESPACE = b"deltaserve-prefix-v1"


def root_hash(model_id: str, cache_salt: str | None = None, extra: tuple[str, ...] = ()) -> bytes:
    h = hashlib.sha256(_NAMESPACE)
    for part in (model_id, cache_salt or "", *extra):
        data = part.encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()


def extend_hashes(
    hashes: list[bytes],
    root: bytes,
    tokens: list[int],
    unit: int,
    spans: tuple[tuple[int, int, bytes], ...] = (),
) -> list[bytes]:
    """Append to `hashes` (the chain so far over `tokens`, with the same `spans`) the hashes of
    every further unit that `tokens` completes; returns `hashes`."""
    for k in range(len(hashes), len(tokens) // unit):
        parent = hashes[-1] if hashes else root
        lo, hi = k * unit, (k + 1) * unit
        data = parent + struct.pack(f"<{unit}q", *tokens[lo:hi])
        data += b"".join(key for start, end, key in spans if start < hi and end > lo)
        hashes.append(hashlib.sha256(data).digest())
    return hashes


def common_units(a: list[bytes] | tuple[bytes, ...], b: list[bytes] | tuple[bytes, ...]) -> int:
    """Number of leading units two chains share. A chained hash equal at unit k implies equal at
    every earlier unit, so this bisects: O(log n) comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
