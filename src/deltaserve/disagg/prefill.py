"""The prefill role: compute a prompt (minus its last token) for a decode instance and hold its
cache until that instance has read it.

`POST /disagg/prefill` (`PrefillRequest`) runs a prefill-only request (this instance's own
prefix cache applies), parks it and answers a `TransferHeader` with a fresh generation; the
regions start at the decode side's `start`. `POST /disagg/release` (`Release`) frees a parked
prompt and says whether it was still parked under that generation, i.e. whether the bytes the
decode side read were those the header describes. Under tensor parallelism every rank holds its
share (`InstanceRanks`): the header names each rank's session, addresses and digests, the KDA
heads cut into the blocks the decode instance's size needs (`plan.head_blocks`). A parked
prompt nobody releases is freed after `ttl_s` (a decode instance that died), so nothing leaks.
Parked bytes are never written while parked: the sequence is off the scheduler and its pages
and live slot are its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from fastapi import APIRouter, Request

from ..cache.handoff import handoff_fingerprint, prompt_hash
from ..engine.exec.rank_transfer import spans
from ..engine.request.sampling_params import SamplingParams
from ..engine.request.sequence import InvalidRequestError
from ..engine.sched.handoff import parked_regions, release_parked
from ..server.async_engine import AsyncEngine
from ..server.errors import APIError
from ..server.request_stream import EngineDeadError
from .images import unpack_image
from .matching import add_match_route
from .plan import head_blocks
from .protocol import PrefillRequest, RankSource, Release, ReleaseReply, TransferHeader
from .ranks import InstanceRanks
from .service import check_secret, engine_state, read_msg, reply

log = logging.getLogger(__name__)


@dataclass
class Parked:
    request_id: str
    generation: int
    deadline: float


class PrefillService:
    def __init__(self, engine: AsyncEngine, ranks: InstanceRanks, secret: str, ttl_s: float = 60.0):
        self.engine, self.ranks, self.secret, self.ttl_s = engine, ranks, secret, ttl_s
        self.cache = engine.core.cache
        self.fingerprint = handoff_fingerprint(self.cache, ranks.world)
        self.parked: dict[str, Parked] = {}
        self._generation = itertools.count(1)
        self.counters: Counter[str] = Counter()
        self._reaper: asyncio.Task | None = None

    async def prefill(self, msg: PrefillRequest) -> TransferHeader:
        if not msg.token_ids:
            raise APIError(400, "a handoff needs at least one prompt token")
        if not 1 <= msg.decode_world <= 4096:
            raise APIError(400, f"decode_world {msg.decode_world} is not a tensor-parallel size")
        if self._reaper is None:  # on the serving loop, started with the first prefill
            self._reaper = asyncio.create_task(self.reap())
        rid = f"pd-{uuid.uuid4().hex}"
        parked = False
        try:  # whatever happens before the prompt is parked under a transfer id frees it
            header = await self._compute(msg, rid)
            parked = True
        finally:
            if not parked:
                self.engine.post(lambda core: release_parked(core, rid))
        self.counters["prefills"] += 1
        self.counters["prefill_tokens"] += len(msg.token_ids)
        self.counters["offered_bytes"] += sum(r[3] for r in header.regions) * self.ranks.world
        return header

    async def _compute(self, msg: PrefillRequest, rid: str) -> TransferHeader:
        """Prefill `msg`'s prompt (with its images) as request `rid`, park it and describe it
        (every rank's digests)."""
        try:
            images = [unpack_image(im) for im in msg.images]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        try:
            stream = await self.engine.add(
                msg.token_ids, SamplingParams(max_tokens=1), rid, images or None, prefill_only=True
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError:
            raise APIError(503, "the engine is not running", "service_unavailable") from None
        finish = None
        try:
            async for d in stream:
                finish = d.finish_reason
        finally:
            stream.abort()
        if finish != "prefilled":
            raise APIError(503, f"the prefill ended with {finish!r}", "service_unavailable")
        blocks = head_blocks(self.ranks.world, msg.decode_world) // self.ranks.world
        try:
            regions = spans(await self.engine.call(lambda core: parked_regions(core, rid, msg.start, blocks)))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        digests = await self.ranks.digests(regions, blocks)
        header = TransferHeader(
            msg.request_id,
            uuid.uuid4().hex,
            next(self._generation),
            prompt_hash(self.cache.model_id, msg.cache_salt, msg.token_ids, tuple(im.digest for im in images)),
            len(msg.token_ids),
            msg.start,
            self.fingerprint,
            [RankSource(e.session, e.bases, d) for e, d in zip(self.ranks.endpoints, digests)],
            regions,
            blocks,
        )
        self.parked[header.transfer_id] = Parked(rid, header.generation, time.monotonic() + self.ttl_s)
        return header

    async def release(self, msg: Release) -> ReleaseReply:
        p = self.parked.get(msg.transfer_id)
        if p is None or p.generation != msg.generation:
            self.counters["stale_releases"] += 1
            return ReleaseReply(False)
        del self.parked[msg.transfer_id]
        self.engine.post(lambda core: release_parked(core, p.request_id))  # runs even if this caller leaves
        self.counters["released"] += 1
        return ReleaseReply(True)

    def expire(self, now: float | None = None) -> int:
        """Free every parked prompt past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        gone = [t for t, p in self.parked.items() if p.deadline <= now]
        for t in gone:
            rid = self.parked.pop(t).request_id
            self.engine.post(lambda core, rid=rid: release_parked(core, rid))
        self.counters["expired"] += len(gone)
        return len(gone)

    async def reap(self, period_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            if self.expire():
                log.warning("freed parked prefills nobody read within %.0f s", self.ttl_s)

    def router(self, render=None) -> APIRouter:
        """The prefill routes; with `render` (`roles.render`) also `/disagg/match`, so the proxy
        can send a prompt to the prefill instance holding its prefix."""
        r = APIRouter()
        if render is not None:
            add_match_route(r, self.engine, self.secret, render)

        @r.post("/disagg/prefill")
        async def prefill(request: Request):
            return reply(await self.prefill(await read_msg(request, self.secret, PrefillRequest)))

        @r.post("/disagg/release")
        async def release(request: Request):
            return reply(await self.release(await read_msg(request, self.secret, Release)))

        @r.get("/disagg/state")
        async def state(request: Request):
            check_secret(request, self.secret)
            extra = {"role": "prefill", "transfers_parked": len(self.parked), **self.counters}
            return await engine_state(self.engine, extra)

        return r
