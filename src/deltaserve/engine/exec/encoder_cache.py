"""`EncoderCache`: each image's projector rows `[N_i, hidden]`, keyed by `ImageInput.digest`, and
the queue of images still being encoded, a bounded amount of tower work per engine step.

Invariants:
- `want(images)` (every step, the images the running sequences still need, in order) pins those
  that are stored, queues an encode (`TowerJob`) for each that is neither stored nor queued, and
  drops queued jobs no running sequence wants any more (an aborted request's encode stops).
  A pinned image is never evicted; pins no longer wanted go back to the LRU part, which is
  bounded by `max_bytes` (an image larger than that is dropped when unpinned).
- `advance(patches)` runs the queue in order for at most `patches` patches' worth of tower work
  (`patches * num_layers` (row, block) pairs, at least one chunk); a finished image is pinned.
  An image of N patches alone is therefore encoded over `ceil(N / patches)` steps.
- `ready(digest)`: the rows are here. `rows(images)` returns stored rows only (the scheduler
  runs no position of an image that is not ready).
- Counting: a miss per encode queued, `encoded_tokens` per finished encode, a hit per distinct
  image per step whose stored rows a step used, except the first use of freshly encoded rows.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable

import torch

from ...model.vision import VisionModel
from ...model.vision_encode import DEFAULT_CHUNK_ROWS, TowerJob
from ..config import DEFAULT_ENCODER_CACHE_BYTES
from ..request.mm_inputs import blocked_at, pending_images
from ..request.multimodal import ImageInput
from ..request.sequence import Sequence


class EncoderCache:
    def __init__(
        self,
        vision: VisionModel,
        max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES,
        patches_per_step: int | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
    ):
        if max_bytes < 0:
            raise ValueError(f"encoder cache bytes must be >= 0, got {max_bytes}")
        self.vision, self.max_bytes, self.chunk_rows = vision, max_bytes, chunk_rows
        self.patches_per_step = patches_per_step or default_patches_per_step(vision)
        if self.patches_per_step < 1:
            raise ValueError(f"patches per step must be positive, got {self.patches_per_step}")
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.pinned: dict[bytes, torch.Tensor] = {}
        self.jobs: deque[tuple[bytes, TowerJob]] = deque()
        self.fresh: set[bytes] = set()
        self.bytes = 0
        self.counters: Counter[str] = Counter()

    def check(self, im: ImageInput) -> None:
        """Raise `ValueError` unless the vision model turns `im` into exactly `num_tokens` rows."""
        (_, h, w), *_ = self.vision.check_grids(im.image.pixel_values, [im.image.grid_thw])
        kh, kw = self.vision.cfg.merge_kernel
        if (h // kh) * (w // kw) != im.image.num_tokens:
            raise ValueError(f"grid {im.image.grid_thw} gives {(h // kh) * (w // kw)} rows, not {im.image.num_tokens}")

    def ready(self, digest: bytes) -> bool:
        return digest in self.pinned or digest in self.entries

    @property
    def pending(self) -> bool:
        """Some encode is queued or under way."""
        return bool(self.jobs)

    def want(self, images: Iterable[ImageInput]) -> None:
        """The images running sequences still need, in order: pin, queue, unpin, drop (see above)."""
        wanted: dict[bytes, ImageInput] = {im.digest: im for im in images}
        for digest in [d for d in self.pinned if d not in wanted]:
            self._put(digest, self.pinned.pop(digest))
            self.fresh.discard(digest)
        self.jobs = deque((d, j) for d, j in self.jobs if d in wanted)
        queued = {d for d, _ in self.jobs}
        for digest, im in wanted.items():
            if digest in self.pinned or digest in queued:
                continue
            stored = self.entries.pop(digest, None)
            if stored is not None:
                self.bytes -= _size(stored)
                self.pinned[digest] = stored
                continue
            job = TowerJob(self.vision, im.image.pixel_values, im.image.grid_thw, self.chunk_rows)
            self.jobs.append((digest, job))
            self.counters["misses"] += 1

    def gate(self, seq: Sequence, start: int) -> int | None:
        """The scheduler's gate: where `seq` meets an image not encoded yet (None: nowhere)."""
        return blocked_at(seq.images, seq.image_starts, start, self.ready) if seq.images else None

    def step(self, running: Iterable[Sequence]) -> int:
        """One engine step's encode: `want` the images the `running` sequences still need, then
        `advance`; returns the (row, block) pairs run."""
        self.want(im for s in running if s.images for im in pending_images(s.images, s.image_starts, s.num_computed))
        return self.advance()

    def advance(self, patches: int | None = None) -> int:
        """Encode queued images, in order, for at most `patches` patches' worth of tower work
        (default `patches_per_step`); returns the (row, block) pairs run."""
        units = (patches or self.patches_per_step) * self.vision.cfg.num_layers
        spent = 0
        while self.jobs and (spent == 0 or spent < units):
            digest, job = self.jobs[0]
            spent += job.advance(max(1, units - spent))
            if job.done:
                self.jobs.popleft()
                self.pinned[digest] = job.result
                self.fresh.add(digest)
                self.counters["encoded_tokens"] += job.result.shape[0]
        return spent

    def rows(self, images: Iterable[ImageInput]) -> dict[bytes, torch.Tensor]:
        """digest -> projector rows of every image in `images`, each of which must be ready."""
        out: dict[bytes, torch.Tensor] = {}
        for im in images:
            if im.digest in out:
                continue
            got = self.pinned.get(im.digest)
            if got is None:
                got = self.entries.get(im.digest)
                if got is None:
                    raise RuntimeError("an image's rows were used before its encode finished")
                self.entries.move_to_end(im.digest)
            if im.digest in self.fresh:
                self.fresh.discard(im.digest)
            else:
                self.counters["hits"] += 1
            out[im.digest] = got
        return out

    def _put(self, digest: bytes, rows: torch.Tensor) -> None:
        size = _size(rows)
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= _size(old)
            self.counters["evictions"] += 1
        self.entries[digest] = rows
        self.bytes += size

    def stats(self) -> dict[str, int]:
        c = self.counters
        held = self.bytes + sum(_size(r) for r in self.pinned.values())
        entries = len(self.entries) + len(self.pinned)
        values = (c["hits"], c["misses"], c["evictions"], c["encoded_tokens"], held, entries)
        return dict(zip(STAT_KEYS, values))


def _size(rows: torch.Tensor) -> int:
    return rows.numel() * rows.element_size()


def default_patches_per_step(vision: VisionModel, memory: int | None = None) -> int:
    """The step budget sized from memory: the patches whose one-chunk working set (activations,
    `VisionConfig.patch_bytes`, plus fp32 scores against `REFERENCE_PATCHES` keys on every head,
    which SDPA's unfused path would form) fits in 1/256 of `memory` (default: the device's
    memory, or RAM), within [MIN_PATCHES_PER_STEP, MAX_PATCHES_PER_STEP]."""
    cfg = vision.cfg
    if memory is None:
        memory = device_memory(vision.mm_projector.post_norm.weight.device)
    per_patch = cfg.patch_bytes + 4 * REFERENCE_PATCHES * cfg.num_heads
    return max(MIN_PATCHES_PER_STEP, min(MAX_PATCHES_PER_STEP, memory // 256 // per_patch))


def device_memory(device: torch.device) -> int:
    """Total memory of `device` (a CUDA device's, else physical RAM)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


REFERENCE_PATCHES = 65536  # keys of a large image: K3's in_patch_limit (spec/model.md §12.1)
MIN_PATCHES_PER_STEP, MAX_PATCHES_PER_STEP = 64, 8192
STAT_KEYS = tuple(f"encoder_cache_{k}" for k in ("hits", "misses", "evictions", "encoded_tokens", "bytes", "entries"))


def encoder_stats(cache: EncoderCache | None) -> dict[str, int]:
    """`cache.stats()`, all zeros without an encoder cache (a model with no vision tower)."""
    return cache.stats() if cache is not None else dict.fromkeys(STAT_KEYS, 0)
