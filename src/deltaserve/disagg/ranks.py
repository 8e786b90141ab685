"""`InstanceRanks`: this instance's ranks' KV transfer engines, as the serving loop sees them.

One process: rank 0's transfer engine hashes and reads on a worker thread while the engine
steps (the regions are parked or reserved: no step writes them). Tensor parallel: every rank
hashes or reads its own pools (`engine.rank_transfer`), driven from the engine thread between
steps, so a read there holds the instance's steps for its duration.
"""

from __future__ import annotations

import asyncio

from ..engine.rank_transfer import RankEndpoint, Spans, rank_digests, rank_read, setup_transfer
from ..parallel.kv_transfer import TransferError
from ..server.async_engine import AsyncEngine


class InstanceRanks:
    def __init__(self, engine: AsyncEngine, kind: str, host: str):
        def setup(core):
            return setup_transfer(core, kind, host)

        self.engine = engine
        endpoints = engine.call_sync(setup) if engine.alive else setup(engine.core)
        failed = [f"rank {r}: {e.error}" for r, e in enumerate(endpoints) if e.error]
        if failed:
            raise TransferError("; ".join(failed))
        self.endpoints: list[RankEndpoint] = endpoints
        self.world = len(endpoints)
        self.transfer = engine.core.runner.transfer
        self.session = endpoints[0].session

    async def digests(self, regions: Spans, timeout: float = 300.0) -> list[list[str]]:
        """Every rank's digests of `regions` (rank 0's first)."""
        if self.world == 1:
            receipts = [await asyncio.to_thread(self.transfer.digests, regions)]
        else:
            receipts = await self.engine.call(lambda core: rank_digests(core, regions), timeout)
        return [r.digests for r in receipts]

    async def read(
        self, sessions: list[str], remote: list[list[tuple[int, int]]], regions: Spans, timeout: float = 300.0
    ) -> int:
        """Rank r reads `remote[r]` from `sessions[r]` into `regions`; the bytes moved in all.
        Raises `TransferError` naming every rank that failed."""
        if self.world == 1:
            receipts = [await asyncio.to_thread(self.transfer.read, sessions[0], remote[0], regions)]
        else:
            receipts = await self.engine.call(lambda core: rank_read(core, sessions, remote, regions), timeout)
        failed = [f"rank {r}: {x.error}" for r, x in enumerate(receipts) if x.error]
        if failed:
            raise TransferError("; ".join(failed))
        return sum(x.moved for x in receipts)
