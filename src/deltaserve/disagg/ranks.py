"""`InstanceRanks`: this instance's ranks' KV transfer engines, as the serving loop sees them.

Every hash and read is a job on each rank (`engine.exec.rank_transfer`): started and collected by
two brief calls on the engine thread, run beside the steps in between (the regions are parked
or reserved: no step writes them), with one process or several alike.

A job never outlives the call that started it: if the caller is cancelled or times out, the
job's collection is posted to the engine thread, where it waits for every rank's share before
anything the caller posts afterwards runs (such as freeing the reservation the bytes land in).
A job still running at the caller's deadline (a hung read) may yet write its regions, so they
can never be given back: the instance stops as failed (`AsyncEngine.fail`) instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from ..engine.exec.messages import Digest, Pull, RankRead
from ..engine.exec.rank_transfer import RankEndpoint, RankReceipt, Spans, collect_job, setup_transfer, start_job
from ..parallel.kv_transfer import TransferError
from ..server.async_engine import AsyncEngine


class InstanceRanks:
    def __init__(self, engine: AsyncEngine, kind: str, host: str, protocol: str = "tcp"):
        def setup(core):
            return setup_transfer(core, kind, host, protocol)

        self.engine = engine
        endpoints = engine.call_sync(setup) if engine.alive else setup(engine.core)
        failed = [f"rank {r}: {e.error}" for r, e in enumerate(endpoints) if e.error]
        if failed:
            raise TransferError("; ".join(failed))
        self.endpoints: list[RankEndpoint] = endpoints
        self.world = len(endpoints)
        self._jobs = itertools.count(1)

    async def digests(self, regions: Spans, blocks: int = 1, timeout: float = 300.0) -> list[dict[str, str]]:
        """Every rank's digests of `regions` (rank 0's first; rank r's head blocks numbered from
        `r * blocks`)."""
        return [r.digests for r in await self._run(Digest(next(self._jobs), regions, blocks), timeout)]

    async def read(self, reads: list[list[RankRead]], timeout: float = 300.0) -> int:
        """Rank r runs `reads[r]`; the bytes moved in all. Raises `TransferError` naming every
        rank that failed."""
        receipts = await self._run(Pull(next(self._jobs), [], reads), timeout)
        failed = [f"rank {r}: {x.error}" for r, x in enumerate(receipts) if x.error]
        if failed:
            raise TransferError("; ".join(failed))
        return sum(x.moved for x in receipts)

    async def _run(self, msg: Digest | Pull, timeout: float) -> list[RankReceipt]:
        deadline = time.monotonic() + timeout
        collected = False
        try:
            own = await self.engine.call(lambda core: start_job(core, msg), timeout)
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(own)), deadline - time.monotonic())
            except asyncio.TimeoutError:
                collected = True  # nothing may wait on it: the instance stops
                self._stuck(f"rank 0's transfer job ran past {timeout:.0f} s")
                raise TransferError(f"the transfer ran past {timeout:.0f} s") from None
            receipts = await self.engine.call(lambda core: self._collect(core, msg.job, deadline), timeout)
            collected = True
            return receipts
        finally:
            if not collected:  # every rank's share ends before what the caller does next
                self.engine.post(lambda core: self._collect(core, msg.job, deadline))

    def _collect(self, core, job: int, deadline: float) -> list[RankReceipt]:
        receipts = collect_job(core, job, max(0.0, deadline - time.monotonic()))
        stuck = [r for r, x in enumerate(receipts) if x.stuck]
        if stuck:
            self._stuck(f"the transfer job of rank(s) {stuck} ran past its deadline")
        return receipts

    def _stuck(self, why: str) -> None:
        self.engine.fail(f"{why}: its bytes may still land in cache it cannot free; stopping")
