"""The control plane between instances: msgspec msgpack messages over HTTP, never pickle, each
request carrying the shared secret (`SECRET_HEADER`, compared in constant time).

`TransferHeader` is what a prefill instance answers for a parked prompt: who it is for
(request id, a per-instance generation counter), what it holds (the prompt's hash and token
count, the handoff fingerprint), where (per tensor-parallel rank the transfer engine session and
pool base addresses; the regions in canonical order, `cache/handoff.py`, the same on every rank,
the KDA heads in the head blocks both instances' sizes need) and each rank's digests of those
bytes per MLA layer and per (KDA layer, head block), blocks numbered across the instance. The
decode side checks every field against its own before it reads, and the digests after.
"""

from __future__ import annotations

import hmac
import os
import secrets
import time
from pathlib import Path

import msgspec

from .. import env

SECRET_HEADER = "X-Deltaserve-Secret"
PREFILL_HEADER = "X-Deltaserve-Prefill"  # the proxy's choice of prefill instance, for a decode instance
SECRET_ENV = env.DISAGG_SECRET.name
MSGPACK = "application/msgpack"


class ImagePixels(msgspec.Struct, frozen=True):
    """One preprocessed image of a prompt (`ImageInput`): the prefill instance encodes it and
    checks `digest` (the image's cache key) against the pixels before it computes anything."""

    digest: str  # hex sha256 over grid_thw and the float32 pixels (`multimodal.image_digest`)
    grid_thw: tuple[int, int, int]
    num_tokens: int
    image_size: tuple[int, int]
    shape: list[int]  # pixel_values' shape; `pixels` are its float32 little-endian bytes
    pixels: bytes


class PrefillRequest(msgspec.Struct, frozen=True):
    request_id: str
    token_ids: list[int]  # the prompt minus its last token (images expanded to their pad runs)
    start: int  # tokens the decode side holds already (a page boundary): regions start here
    cache_salt: str | None = None
    images: list[ImagePixels] = []  # the prompt's images, in order
    decode_world: int = 1  # the decode instance's tensor-parallel size (sets the head blocks)


class RankSource(msgspec.Struct, frozen=True):
    """One rank of the prefill instance: where its pools are and what its regions hash to."""

    session: str  # the rank's transfer engine session
    bases: dict[str, int]  # pool tensor name -> base address in that rank's process
    digests: dict[str, str]  # blake2b of its regions' bytes per MLA layer and (KDA layer, head block)


class TransferHeader(msgspec.Struct, frozen=True):
    request_id: str
    transfer_id: str
    generation: int
    prefix_hash: str  # cache.handoff.prompt_hash of the prompt minus its last token (and image digests)
    num_tokens: int
    start: int
    fingerprint: str  # cache.handoff.handoff_fingerprint (tensor-parallel size aside)
    ranks: list[RankSource]  # every prefill rank (`disagg.plan` picks what each decode rank reads)
    regions: list[tuple[str, int, int, int, int]]  # (tensor, layer, offset, length, block), canonical order
    blocks: int = 1  # KDA head blocks per prefill rank


class Release(msgspec.Struct, frozen=True):
    transfer_id: str
    generation: int


class ReleaseReply(msgspec.Struct, frozen=True):
    valid: bool  # the transfer was parked, with this generation, until this release


class MatchRequest(msgspec.Struct, frozen=True):
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict


class MatchReply(msgspec.Struct, frozen=True):
    """What of a prompt an instance holds. A map on the wire: an older peer ignores the tier
    fields and reads an older reply as holding nothing below the device."""

    num_tokens: int
    joint_tokens: int  # MLA pages and a KDA checkpoint on the device: no prefill needed up to here
    mla_tokens: int  # MLA pages only: transfer bytes saved, compute not
    load: int  # requests waiting on the instance
    host_tokens: int = 0  # resumable by a restore from the host tier (`LowerTier.resumable`)
    disk_tokens: int = 0  # resumable by a restore from the disk tier


_enc = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _enc.encode(msg)


def decode(data: bytes, kind: type):
    return msgspec.msgpack.decode(data, type=kind)


def load_secret(explicit: str | None = None) -> str:
    """The shared secret: `explicit`, else `$DELTASERVE_DISAGG_SECRET`, else a per-user file
    (created 0600 on first use), so instances on one machine agree with no flags."""
    if explicit:
        return explicit
    if env.DISAGG_SECRET.get():
        return env.DISAGG_SECRET.get()
    path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltaserve" / "disagg_secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(50):  # another instance may be writing it right now
            text = path.read_text().strip()
            if text:
                return text
            time.sleep(0.02)
        raise RuntimeError(f"the shared secret file {path} is empty") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path.read_text().strip()


def authorized(given: str | None, secret: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())
