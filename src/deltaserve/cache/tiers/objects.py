"""The tier object: one self-verifying pair of MLA rows and the KDA checkpoint at their end.

An object covers match units `[start, end)` of one hash chain: the MLA latent rows of their
tokens (`mla`: `[mla layers, (end - start) * unit, row]`, token rows, whatever the page size) and,
for every KDA layer, the conv tail and recurrent state at boundary `end` (`tails`, `states`).
`key` is the chain hash of unit `end` (it names the whole prefix), `parent` that of unit `start`
(empty at the root): restoring the object needs the units `[0, start)` from the device or from
the parent object, recursively. Every object is tagged with the producer's fingerprint
(`tier_fingerprint`: the handoff's layout fingerprint, i.e. model, dtypes, shapes, kernel path,
rank count, plus the match unit) and a blake2b digest of its bytes (`handoff.digest`).

On disk an object is one safetensors file (no pickle): tensors `mla`, `tails`, `states` and a
`__metadata__` manifest (format, key, parent, start, end, fingerprint, digest); the header's
data offsets give the sizes, so a torn file is recognised from its header alone. The shared tier
stores the same bytes as the value of key `deltaserve/<FORMAT>/<fingerprint hex>/<key hex>`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..handoff import digest, layout_fingerprint

FORMAT = "deltaserve-tier-object-v1"


class ObjectError(ValueError):
    """An object that must not be restored; `reason` names the check it failed (a metric label)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class Meta:
    """What the index knows of an object without its bytes."""

    key: bytes
    parent: bytes
    start: int
    end: int
    nbytes: int


@dataclass
class TierObject:
    meta: Meta
    mla: torch.Tensor
    tails: torch.Tensor
    states: torch.Tensor
    ready: Any = None  # the CUDA event of the device-to-host copy, None when done

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"mla": self.mla, "tails": self.tails, "states": self.states}

    def digest(self) -> str:
        self.wait()
        return digest([t.contiguous().view(-1).view(torch.uint8) for t in self.tensors().values()], copy=False)


def tier_fingerprint(cache, world: int = 1) -> bytes:
    """sha256 over the handoff's layout fingerprint and the match unit: objects restore only into
    an engine whose pools hold the same bytes for the same prefix."""
    h = hashlib.sha256(layout_fingerprint(cache, world).encode())
    h.update(struct.pack("<Q", cache.policy.unit))
    return h.digest()


def _host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def snapshot(cache, hashes: list[bytes], start: int, end: int, slot: int) -> TierObject:
    """Host copies of units `[start, end)` of chain `hashes` (their pages in the index) and of
    checkpoint slot `slot`. On a device the copies are queued on the current stream (later
    writes to those pages or that slot are ordered after them) and `ready` marks their end."""
    mla, kda = cache.mla, cache.ckpt_pool
    pages = [p for h in hashes[start:end] for p in cache.index.units[h].pages]
    idx = torch.tensor(pages, dtype=torch.long, device=mla.storage.device)
    rows = mla.storage.index_select(1, idx).flatten(1, 2)  # a fresh tensor: no second copy on the host
    obj = TierObject(
        Meta(hashes[end - 1], hashes[start - 1] if start else b"", start, end, 0),
        rows if rows.device.type == "cpu" else _host(rows),
        _host(kda.tails[:, slot]),
        _host(kda.states[:, slot]),
    )
    if mla.storage.device.type == "cuda":
        obj.ready = torch.cuda.Event()
        obj.ready.record()
    obj.meta.nbytes = sum(t.numel() * t.element_size() for t in obj.tensors().values())
    return obj


def install(cache, objs: list[TierObject], k_dev: int, pages: list[int], slot: int) -> None:
    """Write units `[k_dev, end)` of the chain `objs` (shallowest first, contiguous) into `pages`
    (in unit order) and the last object's state into checkpoint slot `slot`."""
    mla, kda, u = cache.mla, cache.ckpt_pool, cache.policy.unit
    parts = []
    for o in objs:
        o.wait()
        lo = max(o.meta.start, k_dev)
        parts.append(o.mla[:, (lo - o.meta.start) * u : (o.meta.end - o.meta.start) * u])
    if pages:
        dev = mla.storage.device
        rows = torch.cat(parts, 1).to(dev).view(mla.storage.shape[0], len(pages), mla.rows_per_page, -1)
        mla.storage.index_copy_(1, torch.tensor(pages, dtype=torch.long, device=dev), rows.to(mla.storage.dtype))
    kda.tails[:, slot].copy_(objs[-1].tails)
    kda.states[:, slot].copy_(objs[-1].states)


def encode(obj: TierObject, fingerprint: bytes) -> bytes:
    """The object's file: safetensors bytes with the manifest as metadata."""
    m = obj.meta
    meta = {
        "format": FORMAT,
        "key": m.key.hex(),
        "parent": m.parent.hex(),
        "start": str(m.start),
        "end": str(m.end),
        "fingerprint": fingerprint.hex(),
        "digest": obj.digest(),
    }
    return st_save({k: t.contiguous() for k, t in obj.tensors().items()}, metadata=meta)


def read_header(head: bytes, file_size: int) -> tuple[Meta, str, str]:
    """(meta, fingerprint hex, digest) from a file's first bytes; `ObjectError("torn")` when the
    header is cut short or malformed, or the sizes it lists disagree with `file_size`."""
    try:
        (n,) = struct.unpack("<Q", head[:8])
        header = json.loads(head[8 : 8 + n])
        meta = header.pop("__metadata__")
        end = max(v["data_offsets"][1] for v in header.values())
        if meta["format"] != FORMAT or set(header) != {"mla", "tails", "states"}:
            raise ObjectError("torn", "not a tier object")
        m = Meta(bytes.fromhex(meta["key"]), bytes.fromhex(meta["parent"]), int(meta["start"]), int(meta["end"]), end)
        fp, dg = meta["fingerprint"], meta["digest"]
    except ObjectError:
        raise
    except Exception as e:  # struct, JSON, key and type errors of a cut or foreign file
        raise ObjectError("torn", f"unreadable header ({type(e).__name__})") from None
    if 8 + n + end != file_size:
        raise ObjectError("torn", f"{file_size} bytes on disk, the header lists {8 + n + end}")
    return m, fp, dg


def decode(data: bytes, fingerprint: bytes, want: Meta) -> TierObject:
    """The object in `data`, verified: header complete, manifest equal to what the index expects
    (`want`), fingerprint ours, digest of the bytes equal to the manifest's."""
    meta, fp, dg = read_header(data, len(data))
    if fp != fingerprint.hex():
        raise ObjectError("fingerprint", "written by another model or layout")
    if (meta.key, meta.parent, meta.start, meta.end) != (want.key, want.parent, want.start, want.end):
        raise ObjectError("manifest", "the manifest names another prefix")
    t = st_load(data)
    obj = TierObject(meta, t["mla"], t["tails"], t["states"])
    if obj.digest() != dg:
        raise ObjectError("digest", "the bytes do not match their digest")
    return obj
