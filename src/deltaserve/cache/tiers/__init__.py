"""Lower tiers under the device pools (host memory, local disk, a shared store): the seam the cache talks to.

The manager tells its tier three things, all on the engine thread:
- `stored`: a checkpoint was just registered at unit boundary `k` of a chain (write-through: the
  tier copies what it keeps now, while the pages and the slot are valid; the pages of units
  `[0, k)` are in the index);
- `restore`: a lookup whose device hit ends at `k_hit` (MLA units cached up to `k_mla`) may be
  lengthened: the tier may install a longer prefix (MLA pages and the checkpoint at its end)
  into the device index and says whether it did (True), or that it is reading one (None: the
  request waits a step and looks up again);
- `resumable`: read-only, what `restore` could install, per tier (for routing: `/disagg/match`);
- `take_unit` / `take_checkpoint`: eviction from the device hands over what it drops (valid
  during the call; a tier must not keep page ids or slots). With write-through they keep
  nothing: the object is below already. A checkpoint dropped for a refused restore is not
  handed over (its state is not the one its hash names).
`cache` is the calling `CacheManager`. `DROP`, the default, keeps nothing and restores nothing;
`cache.tiers.store.TieredStore` is the host + disk + shared-store implementation.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..kda_pool import KdaStatePool
from ..mla_pool import MlaPagePool


class LowerTier(Protocol):
    def take_unit(self, h: bytes, parent: bytes | None, pages: list[int], pool: MlaPagePool) -> None:
        """An evicted unit: its chain hash, its parent's and its pages (valid during the call)."""

    def take_checkpoint(self, h: bytes, slot: int, pool: KdaStatePool) -> None:
        """An evicted checkpoint: the unit hash it ends and its slot (valid during the call)."""

    def stored(self, cache: Any, hashes: list[bytes], k: int, slot: int) -> None:
        """A checkpoint (`slot`, tagged) was registered at unit boundary `k` of chain `hashes`."""

    def restore(self, cache: Any, hashes: list[bytes], k_mla: int, k_hit: int) -> bool | None:
        """Install a prefix longer than `k_hit` units of `hashes` into the device index, if held."""

    def resumable(self, hashes: list[bytes], k_mla: int) -> dict[str, int]:
        """Per tier name: the most units of `hashes` a restore from it could resume (the
        checkpoint object there, the rest of the chain held), from index lookups only: no object
        is read, nothing is installed or made recently used. Tiers holding none are left out."""


class Drop:
    """The tier that keeps nothing."""

    def take_unit(self, h: bytes, parent: bytes | None, pages: list[int], pool: MlaPagePool) -> None:
        return None

    def take_checkpoint(self, h: bytes, slot: int, pool: KdaStatePool) -> None:
        return None

    def stored(self, cache: Any, hashes: list[bytes], k: int, slot: int) -> None:
        return None

    def restore(self, cache: Any, hashes: list[bytes], k_mla: int, k_hit: int) -> bool | None:
        return False

    def resumable(self, hashes: list[bytes], k_mla: int) -> dict[str, int]:
        return {}


DROP = Drop()
