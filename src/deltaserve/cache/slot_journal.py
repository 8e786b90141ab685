"""`SlotJournal`: the KDA slot writes a cache manager makes outside a forward pass, in order.

Under tensor parallelism every rank holds the same pools over its own heads, but only rank 0
runs the `CacheManager` that decides what goes where. The only tensor writes that manager makes
itself are zeroing a slot it allocates and copying a slot between the live and checkpoint pools
(restore on a prefix hit, snapshot at a boundary); everything else is bookkeeping or happens in
the forward pass. Replaying the journal on another rank's pools, in order, before the forward
pass that follows, leaves them holding exactly what rank 0's pools hold, head for head.

Pools are named: `LIVE` (one slot per running sequence) and `CHECKPOINT`; `MLA` is the page
pool, whose only write outside a forward pass is a page copy (`PageCopyOp`: a handoff's `n > 1`
fork copies the prompt's partial last page). The ops are msgspec
structs, so the worker protocol (`engine.exec.messages`) carries them as they are.
"""

from __future__ import annotations

import msgspec

LIVE, CHECKPOINT, MLA = "live", "checkpoint", "mla"


class ZeroOp(msgspec.Struct, tag="zero", frozen=True):
    pool: str
    slot: int


class CopyOp(msgspec.Struct, tag="copy", frozen=True):
    src_pool: str
    src_slot: int
    dst_pool: str
    dst_slot: int


class PageCopyOp(msgspec.Struct, tag="page_copy", frozen=True):
    """Copy every MLA layer's rows of page `src` into page `dst` (a handoff's fork)."""

    src: int
    dst: int


class SlotJournal:
    """Appends `ZeroOp`/`CopyOp`s as the manager makes them; `take()` hands them over once."""

    def __init__(self):
        self._ops: list[ZeroOp | CopyOp | PageCopyOp] = []

    def zero(self, pool: str, slot: int) -> None:
        self._ops.append(ZeroOp(pool, slot))

    def copy(self, src_pool: str, src_slot: int, dst_pool: str, dst_slot: int) -> None:
        self._ops.append(CopyOp(src_pool, src_slot, dst_pool, dst_slot))

    def copy_page(self, src: int, dst: int) -> None:
        self._ops.append(PageCopyOp(src, dst))

    def take(self) -> list[ZeroOp | CopyOp | PageCopyOp]:
        ops, self._ops = self._ops, []
        return ops


def replay(ops, pools: dict) -> None:
    """Apply `ops` (in order) to `pools` (name -> `KdaStatePool`, and `MLA` -> the `MlaPagePool`),
    as the recording manager did."""
    for op in ops:
        if isinstance(op, ZeroOp):
            pools[op.pool].zero(op.slot)
        elif isinstance(op, PageCopyOp):
            pools[MLA].copy_page(op.src, op.dst)
        else:
            pools[op.dst_pool].copy_from(pools[op.src_pool], op.src_slot, op.dst_slot)
