"""The worker protocol: what rank 0 (the scheduler) tells the other tensor-parallel ranks.

Typed, versioned msgspec structs encoded as msgpack; nothing is pickled. `Hello` opens a session
(protocol version, pool sizes, the start-up memory each rank reports back through a tensor
collective); then one `Step` per forward pass: the slot writes the cache manager made since the
last step (`cache.slot_journal`), the packed batch layout and which rows need logits (the
vocab-parallel lm_head's all-gather needs every rank) and the image embedding rows rank 0's
vision model made for the step (`EmbedRows`, raw tensor bytes with explicit dtype and shape);
a `Step` that verifies speculative drafts (`verify`) is followed by one `Fold`: how many leading
tokens of each verify sequence were verified, which every rank folds into its own KDA heads'
live states from the step's kept inputs; `Snapshot` gathers every rank's pools (a
check); `TransferSetup`, `Digest`, `Pull` and `Collect` move a prefill/decode handoff's bytes on
every rank (`rank_transfer`: jobs that run beside the steps, each rank answering through
`ControlChannel.gather`); under wide expert parallelism `Idle` runs the zero-token forward (every
MoE layer's exchange, so an idle replica's ranks keep the others in step) and `ExpertLoad` gathers
each rank's tokens per local expert; `Shutdown` ends it.
"""

from __future__ import annotations

import msgspec
import torch

from ...cache.slot_journal import CopyOp, PageCopyOp, ZeroOp

PROTOCOL_VERSION = 6
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Hello(msgspec.Struct, tag="hello", frozen=True):
    version: int
    num_pages: int
    page_size: int
    num_slots: int
    num_checkpoint_slots: int
    kv_dtype: str
    state_dtype: str


class TensorBytes(msgspec.Struct, frozen=True):
    """A tensor as raw little-endian bytes: `dtype` (a name in `_DTYPES`), `shape`, row-major `data`."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorBytes":
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"cannot send a {t.dtype} tensor")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        return cls(name, list(t.shape), raw.numpy().tobytes())

    def tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor; raises `ValueError` on an unknown dtype or a size that does not match."""
        dtype = _DTYPES.get(self.dtype)
        if dtype is None:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}")
        numel = 1
        for n in self.shape:
            numel *= n
        if len(self.data) != numel * dtype.itemsize:
            raise ValueError(f"{len(self.data)} bytes for a {self.dtype} tensor of shape {self.shape}")
        flat = (
            torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(dtype).reshape(self.shape).to(device)


class EmbedRows(msgspec.Struct, frozen=True):
    """Input embeddings that replace the token embeddings at packed positions `index`
    (`KimiForCausalLM.forward`'s `embeds`): `rows` is `[len(index), hidden]`."""

    index: list[int]
    rows: TensorBytes


class Step(msgspec.Struct, tag="step", frozen=True):
    """One forward pass: `ForwardBatch`'s arguments, the slot writes to replay before it, the
    packed rows whose logits are computed after it, and the image rows it injects (if any)."""

    ops: list[ZeroOp | CopyOp | PageCopyOp]
    input_ids: list[int]
    context_lens: list[int]
    new_lens: list[int]
    page_tables: list[list[int]]
    slots: list[int]
    export_offsets: list[list[int]] | None
    export_slots: list[int]
    logit_rows: list[int]
    embeds: EmbedRows | None = None
    verify: list[bool] | None = None  # per sequence: a speculative verify (`ForwardBatch(verify=)`)


class Fold(msgspec.Struct, tag="fold", frozen=True):
    """Fold the previous verify `Step`'s verified tokens (`ForwardBatch.set_verified`) into the live
    KDA states."""

    verified: list[int]


class Snapshot(msgspec.Struct, tag="snapshot", frozen=True):
    """Every rank joins `pool_snapshot` (a check of the pools, between steps)."""


class TransferSetup(msgspec.Struct, tag="transfer_setup", frozen=True):
    """Every rank starts a KV transfer engine (`engine` at `host` over `protocol`) over its own
    pools and answers its `RankEndpoint`."""

    engine: str
    host: str
    protocol: str = "tcp"


class Digest(msgspec.Struct, tag="digest", frozen=True):
    """Every rank r starts hashing `regions` of its pools (`cache.handoff.region_digests`, head
    blocks numbered from `r * blocks`) as transfer job `job`."""

    job: int
    regions: list[tuple[str, int, int, int, int]]  # (tensor, layer, offset, length, block)
    blocks: int = 1  # head blocks per rank


class RankRead(msgspec.Struct, frozen=True):
    """Read `remote` (address, length) of transfer session `session` into `regions` of this
    rank's own pools, pairwise."""

    session: str
    remote: list[tuple[int, int]]
    regions: list[tuple[str, int, int, int, int]]


class Pull(msgspec.Struct, tag="pull", frozen=True):
    """Every rank r replays `ops` (the reservation's slot zeroing must precede the bytes), then
    starts its reads `reads[r]` (from one or several peers' sessions) as transfer job `job`."""

    job: int
    ops: list[ZeroOp | CopyOp | PageCopyOp]
    reads: list[list[RankRead]]


class Collect(msgspec.Struct, tag="collect", frozen=True):
    """Every rank waits up to `wait_s` for its transfer job `job` and answers its `RankReceipt`
    (one still running then is `stuck`)."""

    job: int
    wait_s: float


class Idle(msgspec.Struct, tag="idle", frozen=True):
    """Wide EP: every rank runs `KimiForCausalLM.idle_forward` (this replica has nothing scheduled)."""


class ExpertLoad(msgspec.Struct, tag="expert_load", frozen=True):
    """Wide EP: every rank answers its `model.experts.expert_load` (msgpack) through `gather`."""


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    reason: str = ""


Message = Hello | Step | Fold | Snapshot | TransferSetup | Digest | Pull | Collect | Idle | ExpertLoad | Shutdown

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """The message in `data`; raises `msgspec.ValidationError` on anything but a `Message`."""
    return _decoder.decode(data)
