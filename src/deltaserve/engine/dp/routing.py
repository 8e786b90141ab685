"""Prefix-affine, load-bounded routing over engine replicas, shared by the offline `LLM`'s
data-parallel client (engine/dp/client.py) and `deltaserve serve --data-parallel-size`'s front.

Invariants: `rendezvous(key, n)` depends only on `key` and `n` (the same key always lands on
the same replica, so requests sharing a prefix meet their cached prefix); `pick` keeps that
replica unless it is more than `spill` requests busier than the least loaded one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

SPILL = 4  # in-flight requests a prefix-affine replica may exceed the least loaded one by


def rendezvous(key: bytes, n: int) -> int:
    """The replica in [0, n) whose hash with `key` is highest (rendezvous hashing)."""
    return rendezvous_among(key, range(n))


def rendezvous_among(key: bytes, candidates: Iterable[int]) -> int:
    """The replica among `candidates` whose hash with `key` is highest: a key keeps its replica
    while that one is a candidate, and only the keys of a missing one move."""
    return max(candidates, key=lambda i: hashlib.sha256(key + i.to_bytes(2, "little")).digest())


def pick(key: bytes, loads: Sequence[int], spill: int = SPILL, among: Sequence[int] | None = None) -> int:
    """`key`'s rendezvous replica (of `among`, default all) unless its load exceeds the least
    one's by more than `spill`: then the least loaded (the lowest index among equals)."""
    among = range(len(loads)) if among is None else among
    home = rendezvous_among(key, among)
    least = min(among, key=loads.__getitem__)
    return home if loads[home] <= loads[least] + spill else least


def token_key(prompt_ids: Sequence[int], cache_salt: str | None, unit: int) -> bytes:
    """The routing key of a tokenized prompt: its salt and first `unit` tokens (the prefix
    cache's hit granularity: prompts that share less can share no cached prefix)."""
    head = array("q", prompt_ids[:unit]).tobytes()
    return (cache_salt or "").encode() + b"\0" + head
