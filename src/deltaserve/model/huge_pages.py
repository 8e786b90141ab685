"""Host weights in transparent huge pages (2 MiB), so decode's weight streams walk one page table
entry per 2 MiB instead of per 4 KiB (on an AMD EPYC without AMX: batch-1 decode x1.14 median in
interleaved pairs; see docs/performance.md, "Weights in huge pages").

The loader memory-maps the checkpoint (file pages, 4 KiB) and stacks experts in torch's allocator
(4 KiB pages unless `THP_MEM_ALLOC_ENABLE` was set before torch started). `place_weights` copies
every CPU weight into one private anonymous arena advised `MADV_HUGEPAGE` and starting on a 2 MiB
boundary: the kernel backs it with huge pages when THP is `always` or `madvise` (with `never` it
is an ordinary anonymous copy). It is skipped, with a log line, where the weights would not fit in
the memory available now (the memory map then keeps a model larger than RAM runnable), and by
`DELTASERVE_HUGE_PAGES=0`. Values are unchanged (a byte copy); tensors that are one object (a
tied `lm_head`) stay one object. Each process holds its own copy: data-parallel replicas on one
machine no longer share the checkpoint's page cache (as in vLLM, where each loads its weights).
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

from .. import env

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on its own 4 KiB page of the arena
SPARE = 0.9  # fraction of MemAvailable the arena may take
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_enabled() -> bool:
    """Not turned off, and a kernel with transparent huge pages (without them `MADV_HUGEPAGE` fails)."""
    off = not env.HUGE_PAGES.on()
    return not off and hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists(THP_SETTING)


def huge_page_setting() -> str:
    """The kernel's THP setting line (e.g. "always [madvise] never") where weights go to huge pages,
    else "off" (`DELTASERVE_HUGE_PAGES=0`, or a kernel without THP)."""
    if not huge_pages_enabled():
        return "off"
    try:
        with open(THP_SETTING) as f:
            return f.read().strip()
    except OSError:
        return "off"


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (zeros) in private anonymous memory advised `MADV_HUGEPAGE`, its
    first byte on a 2 MiB boundary. The tensor keeps the mapping alive."""
    arena = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(arena, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes]


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _padded(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // ALIGN) * ALIGN


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0


def place_weights(tensors: dict) -> dict:
    """`tensors` (any keys) with every contiguous CPU tensor moved into one huge-page arena (see
    the module docstring), entry by entry: an original nothing else holds is freed as soon as its
    copy exists, so the peak is the arena plus one tensor. Updated in place and returned; other
    tensors are left as they are."""
    sizes = {id(t): _padded(t) for t in tensors.values() if _movable(t)}
    total = sum(sizes.values())
    if not total or not huge_pages_enabled():
        return tensors
    free = available_bytes()
    if free is not None and total > SPARE * free:
        log.info("weights stay memory-mapped: %.1f GiB do not fit in %.1f GiB available", total / 2**30, free / 2**30)
        return tensors
    try:
        arena = huge_page_bytes(total)
    except OSError as err:  # the mapping or the advice refused: nothing gained by a copy
        log.info("weights stay memory-mapped: no huge-page arena (%s)", err)
        return tensors
    offset, moved = 0, {}
    for key in list(tensors):
        t = tensors[key]
        if id(t) not in sizes:  # every value was alive when `sizes` was taken: ids are unambiguous
            continue
        if id(t) not in moved:
            dst = arena[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            moved[id(t)] = dst.copy_(t)
            offset += sizes[id(t)]
        tensors[key] = moved[id(t)]
        del t
    log.info("weights in huge pages: %.1f MiB", total / 2**20)
    return tensors
