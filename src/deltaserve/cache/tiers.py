"""Where evicted cache goes: the seam between the pools and a lower tier (host memory, disk).

`PrefixIndex` hands every MLA unit and KDA checkpoint it evicts to its tier (`LowerTier`) before it
frees the pages or the slot, so their bytes are still in the pools during the call; the tier copies
what it keeps and must not keep the page ids or the slot. A checkpoint dropped for a refused
restore is not handed over (its state is not the one its hash names). `DROP`, the default, keeps
nothing: eviction drops the unit, as it always did.
"""

from __future__ import annotations

from typing import Protocol

from .kda_pool import KdaStatePool
from .mla_pool import MlaPagePool


class LowerTier(Protocol):
    def take_unit(self, h: bytes, parent: bytes | None, pages: list[int], pool: MlaPagePool) -> None:
        """An evicted unit: its chain hash, its parent's and its pages (valid during the call)."""

    def take_checkpoint(self, h: bytes, slot: int, pool: KdaStatePool) -> None:
        """An evicted checkpoint: the unit hash it ends and its slot (valid during the call)."""


class Drop:
    """The tier that keeps nothing."""

    def take_unit(self, h: bytes, parent: bytes | None, pages: list[int], pool: MlaPagePool) -> None:
        return None

    def take_checkpoint(self, h: bytes, slot: int, pool: KdaStatePool) -> None:
        return None


DROP = Drop()
