"""Fail-closed KDA checkpoints: every stored state carries a `CheckpointTag` naming exactly what
it is, and a restore uses it only if the tag matches the restoring request.

A tag holds the chained hash of the prefix the state ends (`hashing.extend_hashes`), the token
count of that prefix and the producer's fingerprint (`state_fingerprint`: model identity, pool
dtypes and shapes, the state layout version and the KDA kernel path that computed it). A state
whose tag differs in any field is never restored: it is refused, counted and dropped, and the
request falls back to a shorter hit or a cold prefill. Tags are plain bytes and ints, so the
same check applies to states that travel between processes.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

# Bump when the meaning of a slot's bytes changes (tail/state order, shapes, conv tail contents).
STATE_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class CheckpointTag:
    prefix_hash: bytes
    num_tokens: int
    fingerprint: bytes


def state_fingerprint(model_id: str, tails: torch.Tensor, states: torch.Tensor, kernel: str) -> bytes:
    """sha256 over everything that decides a state's bytes besides the prefix itself: the model
    (`model_id` names the checkpoint by content, `model.identity`, and the weight dtype), the pool
    tensors' dtypes and per-slot shapes (`[layers, slots, ...]`, slots excluded), the layout
    version and the KDA kernel path."""
    h = hashlib.sha256(b"deltaserve-kda-state")
    parts = (
        model_id,
        str(tails.dtype),
        str(states.dtype),
        repr((tails.shape[0], *tails.shape[2:])),
        repr((states.shape[0], *states.shape[2:])),
        str(STATE_LAYOUT_VERSION),
        kernel,
    )
    for part in parts:
        data = part.encode()
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.digest()
