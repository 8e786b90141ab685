"""The worker protocol: what rank 0 (the scheduler) tells the other tensor-parallel ranks.

Typed, versioned msgspec structs encoded as msgpack; nothing is pickled. `Hello` opens a session
(protocol version, pool sizes, the start-up memory each rank reports back through a tensor
collective); then one `Step` per forward pass: the slot writes the cache manager made since the
last step (`cache.slot_journal`), the packed batch layout and which rows need logits (the
vocab-parallel lm_head's all-gather needs every rank); `Snapshot` gathers every rank's pools (a
check); `Shutdown` ends it.
"""

from __future__ import annotations

import msgspec

from ..cache.slot_journal import CopyOp, ZeroOp

PROTOCOL_VERSION = 1


class Hello(msgspec.Struct, tag="hello", frozen=True):
    version: int
    num_pages: int
    page_size: int
    num_slots: int
    num_checkpoint_slots: int
    kv_dtype: str
    state_dtype: str


class Step(msgspec.Struct, tag="step", frozen=True):
    """One forward pass: `ForwardBatch`'s arguments, the slot writes to replay before it, and the
    packed rows whose logits are computed after it."""

    ops: list[ZeroOp | CopyOp]
    input_ids: list[int]
    context_lens: list[int]
    new_lens: list[int]
    page_tables: list[list[int]]
    slots: list[int]
    export_offsets: list[list[int]] | None
    export_slots: list[int]
    logit_rows: list[int]


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True):
    """Every rank joins `pool_snapshot` (a check of the pools, between steps)."""


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    reason: str = ""


Message = Hello | Step | Snapshot | Shutdown

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """The message in `data`; raises `msgspec.ValidationError` on anything but a `Message`."""
    return _decoder.decode(data)
