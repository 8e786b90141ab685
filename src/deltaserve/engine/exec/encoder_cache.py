"""`EncoderCache`: each image's projector rows `[N_i, hidden]`, keyed by `ImageInput.digest`,
LRU, bounded by bytes.

Invariants:
- An image is encoded whole the first time a step needs any of its rows; every image a step
  misses is encoded in one packed `VisionModel` call (images attend only to themselves, so
  packing does not change any row).
- `rows(images)` returns every requested image's rows, stored or not: a step never loses what it
  asked for to eviction, and an image larger than the whole budget is used but not kept.
- Counting is per distinct image per step: a hit if its rows were stored, else a miss (an image
  whose span several steps split is looked up once per step).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

import torch

from ...model.vision import VisionModel
from ..config import DEFAULT_ENCODER_CACHE_BYTES
from ..request.multimodal import ImageInput


class EncoderCache:
    def __init__(self, vision: VisionModel, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES):
        if max_bytes < 0:
            raise ValueError(f"encoder cache bytes must be >= 0, got {max_bytes}")
        self.vision, self.max_bytes = vision, max_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.counters: Counter[str] = Counter()

    def check(self, im: ImageInput) -> None:
        """Raise `ValueError` unless the vision model turns `im` into exactly `num_tokens` rows."""
        (_, h, w), *_ = self.vision.check_grids(im.image.pixel_values, [im.image.grid_thw])
        kh, kw = self.vision.cfg.merge_kernel
        if (h // kh) * (w // kw) != im.image.num_tokens:
            raise ValueError(f"grid {im.image.grid_thw} gives {(h // kh) * (w // kw)} rows, not {im.image.num_tokens}")

    def rows(self, images: Iterable[ImageInput]) -> dict[bytes, torch.Tensor]:
        """digest -> projector rows of every image in `images`, encoding the misses together."""
        out: dict[bytes, torch.Tensor] = {}
        misses: dict[bytes, ImageInput] = {}
        for im in images:
            if im.digest in out or im.digest in misses:
                continue
            hit = self.entries.get(im.digest)
            if hit is not None:
                self.entries.move_to_end(im.digest)
                out[im.digest] = hit
                self.counters["hits"] += 1
            else:
                misses[im.digest] = im
        if misses:
            self.counters["misses"] += len(misses)
            for digest, rows in zip(misses, self._encode(list(misses.values()))):
                out[digest] = rows
                self._put(digest, rows)
        return out

    @torch.inference_mode()
    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        device = self.vision.mm_projector.post_norm.weight.device
        patches = torch.cat([im.image.pixel_values for im in images]).to(device, non_blocking=True)
        rows = self.vision(patches, [im.image.grid_thw for im in images])
        self.counters["encoded_tokens"] += rows.shape[0]
        return list(rows.split([im.image.num_tokens for im in images]))

    def _put(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
            self.counters["evictions"] += 1
        self.entries[digest] = rows
        self.bytes += size

    def stats(self) -> dict[str, int]:
        c = self.counters
        values = (c["hits"], c["misses"], c["evictions"], c["encoded_tokens"], self.bytes, len(self.entries))
        return dict(zip(STAT_KEYS, values))


STAT_KEYS = tuple(f"encoder_cache_{k}" for k in ("hits", "misses", "evictions", "encoded_tokens", "bytes", "entries"))


def encoder_stats(cache: EncoderCache | None) -> dict[str, int]:
    """`cache.stats()`, all zeros without an encoder cache (a model with no vision tower)."""
    return cache.stats() if cache is not None else dict.fromkeys(STAT_KEYS, 0)
