"""The data-parallel protocol: what the offline `LLM` (the client, engine/dp/client.py) and its
engine replicas (engine/dp/replica.py) say to each other over one socket per replica.

Typed, versioned msgspec structs encoded as msgpack, each frame an 8-byte little-endian length
and the message; nothing is pickled. Sampling params travel as their fields (`params_to_wire`),
images as raw pixel bytes with dtype and shape (`TensorBytes`), finished requests as the
`RequestOutput` dataclasses themselves.

Client -> replica: `Add` (a batch: every request validated before any is queued, else
`Added.error` names the first refused and nothing stays queued), `Abort`, `Call` (stats,
reset_prefix_cache, check_integrity; answered by `Result`), `Shutdown`. Replica -> client:
`Ready` once after start-up (or `Failed`; with the prefix cache it names the `model_id` and
`unit` the client hashes prompts with), `Added`, `Outputs` (finished requests; also sent empty at
least every `HEARTBEAT` seconds while it has work), `CacheEvents` (`cache.events`: where a prefix
can resume, after each step or call that changed it), `Result`, `Failed` (fatal: the replica
exits).
"""

from __future__ import annotations

import dataclasses
import select
import socket
from typing import Any

import msgspec

from ...cache.events import CacheEvents
from ...model.image_processor import ProcessedImage
from ..exec.messages import TensorBytes
from ..request.multimodal import ImageInput
from ..request.outputs import RequestOutput
from ..request.sampling_params import SamplingParams
from ..request.structured import Special, StructuredOutput

DP_PROTOCOL_VERSION = 2
HEARTBEAT = 1.0  # most seconds a busy replica stays silent between two steps
_HEADER = 8


class WireImage(msgspec.Struct, frozen=True):
    pixel_values: TensorBytes
    grid_thw: list[int]
    num_tokens: int
    image_size: list[int]
    digest: bytes


class WireRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # `params_to_wire`
    prompt: str | None = None
    cache_salt: str | None = None
    images: list[WireImage] | None = None


class Add(msgspec.Struct, tag="add", frozen=True):
    seq: int  # echoed by `Added`, so a late answer to an interrupted call is told apart
    requests: list[WireRequest]


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class Call(msgspec.Struct, tag="call", frozen=True):
    seq: int  # echoed by `Result`
    name: str  # one of `CALLS`


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


class Ready(msgspec.Struct, tag="ready", frozen=True):
    version: int
    max_model_len: int
    vocab_size: int
    family: str
    media_pad_id: int | None
    accepts_images: bool
    rank_memory: list[dict[str, int]] | None
    model_id: str = ""  # the prefix cache's (`cache.hashing.root_hash`); "" without one
    unit: int = 0  # its match unit in tokens; 0 without a prefix cache


class Added(msgspec.Struct, tag="added", frozen=True):
    """`error` None: all queued. Else nothing is: `index` (in the batch) was refused in
    `phase` 0 (validation) or 1 (queueing: grammar compile, reasoning budget)."""

    seq: int
    error: str | None = None
    index: int = 0
    phase: int = 0


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    outputs: list[RequestOutput]


class Result(msgspec.Struct, tag="result", frozen=True):
    seq: int
    value: Any = None
    error: str | None = None


class Failed(msgspec.Struct, tag="failed", frozen=True):
    reason: str


CALLS = ("stats", "reset_prefix_cache", "check_integrity")
ToReplica = Add | Abort | Call | Shutdown
ToClient = Ready | Added | Outputs | Result | Failed | CacheEvents


def _piece(p: str | Special) -> str | dict:
    return {"special": p.name} if isinstance(p, Special) else p


def _unpiece(p: str | dict) -> str | Special:
    return Special(p["special"]) if isinstance(p, dict) else p


def params_to_wire(p: SamplingParams) -> dict[str, Any]:
    """Every field of `p` as msgpack-able values (the inverse is `params_from_wire`)."""
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    s = p.structured
    out["structured"] = (
        None
        if s is None
        else {"json_schema": s.json_schema, "prefix": [_piece(x) for x in s.prefix], "grammar": s.grammar}
    )
    out["reasoning_end"] = [_piece(x) for x in p.reasoning_end]
    out["keep_special_token_ids"] = sorted(p.keep_special_token_ids)
    return out


def params_from_wire(d: dict[str, Any]) -> SamplingParams:
    d = dict(d)
    s = d["structured"]
    d["structured"] = (
        None
        if s is None
        else StructuredOutput(s["json_schema"], tuple(map(_unpiece, s["prefix"])), s.get("grammar", ""))
    )
    d["reasoning_end"] = tuple(map(_unpiece, d["reasoning_end"]))
    return SamplingParams(**d)


def image_to_wire(im: ImageInput) -> WireImage:
    p = im.image
    return WireImage(TensorBytes.of(p.pixel_values), list(p.grid_thw), p.num_tokens, list(p.image_size), im.digest)


def request_to_wire(rid: str, ids, p: SamplingParams, text, salt, images) -> WireRequest:
    """One request as `LLM.generate` stages it (id, prompt ids, params, text, salt, images)."""
    ims = None if images is None else [image_to_wire(im) for im in images]
    return WireRequest(rid, list(ids), params_to_wire(p), text, salt, ims)


def image_from_wire(w: WireImage) -> ImageInput:
    image = ProcessedImage(w.pixel_values.tensor(), tuple(w.grid_thw), w.num_tokens, tuple(w.image_size))
    return ImageInput(image, w.digest)


class Link:
    """One end of a replica's socket: whole messages of one union type in, of another out.
    Received bytes are kept until a frame is whole, so an interrupt (Ctrl-C) between two reads
    loses nothing; `ready` sees a buffered frame as well as the socket."""

    def __init__(self, sock: socket.socket, incoming: Any):
        self.sock = sock
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(incoming)
        self._buf = bytearray()

    def send(self, msg: msgspec.Struct) -> None:
        data = self._enc.encode(msg)
        self.sock.sendall(len(data).to_bytes(_HEADER, "little") + data)

    def buffered(self) -> bool:
        """A whole frame is already received."""
        buf = self._buf
        return len(buf) >= _HEADER and len(buf) >= _HEADER + int.from_bytes(buf[:_HEADER], "little")

    def ready(self, timeout: float | None) -> bool:
        """True once a message (or end of stream) can be read, waiting at most `timeout` s."""
        return self.buffered() or bool(select.select([self.sock], [], [], timeout)[0])

    def recv(self) -> Any:
        """The next message; raises `EOFError` when the other end has closed."""
        while not self.buffered():
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("the other end closed the connection")
            self._buf += chunk
        n = _HEADER + int.from_bytes(self._buf[:_HEADER], "little")
        data = bytes(self._buf[_HEADER:n])
        del self._buf[:n]
        return self._dec.decode(data)

    def close(self) -> None:
        self.sock.close()
