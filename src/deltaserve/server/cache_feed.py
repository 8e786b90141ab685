"""The resumable-prefix feed between a replica server and the data-parallel front.

Replica side, `GET /internal/cache_events?consumer=ID`: a long poll answered with one msgpack
`FeedReply` (msgspec, never pickle) as soon as the replica's `cache.events.EventLog` has
something, or after `wait` seconds with nothing. The reply names what the front needs to hash
prompts as this replica's prefix cache does (`model_id`, `unit`, `family`). A `consumer` other
than the last one's gets a reset first (the whole set of resumable boundaries); the same consumer
continues where its last reply ended. 404 without a prefix cache. It needs the API key, as every
route does when one is set.

Front side, `Feeds`: one task per replica polling it while it is live and applying each batch to
the front's `Router` index. A replica that is down, restarted (a new URL) or whose poll failed
has its entries forgotten, and the next poll is a new consumer (a reset), so the index never
keeps what a dead replica published.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import httpx
import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..cache.events import CacheEvents, EventLog, publish
from ..engine.dp.routing import Router
from .errors import APIError
from .state import State

log = logging.getLogger("deltaserve.feed")

FEED_PATH = "/internal/cache_events"
POLL_S = 0.02  # how often a held poll looks for events
WAIT_S = 1.0  # how long a poll is held without events
RETRY_S = 0.5  # pause after a failed poll
MSGPACK = "application/x-msgpack"


class FeedReply(msgspec.Struct, frozen=True):
    model_id: str
    unit: int
    family: str
    batch: CacheEvents | None = None


router = APIRouter()


def _attach(core, events: EventLog) -> tuple[str, int] | None:
    cache = core.cache
    if not cache.prefix_enabled:
        return None
    if cache.index.events is not events:
        publish(cache, events)
    return cache.model_id, cache.policy.unit


@router.get(FEED_PATH)
async def cache_events(request: Request, state: State, consumer: str = "", wait: float = WAIT_S):
    app, engine = request.app.state, state.engine
    events: EventLog | None = getattr(app, "cache_events", None)
    if events is None:
        events = app.cache_events = EventLog()
    where = await engine.call(lambda core: _attach(core, events))
    if where is None:
        raise APIError(404, "this server has no prefix cache to publish", "not_found_error")
    if consumer != getattr(app, "cache_events_consumer", None):
        app.cache_events_consumer = consumer
        events.resync()
    deadline = asyncio.get_running_loop().time() + min(max(wait, 0.0), 5.0)
    while not events.waiting() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(POLL_S)
    batch = await engine.call(lambda core: events.drain()) if events.waiting() else None
    reply = FeedReply(where[0], where[1], engine.family, batch)
    return Response(msgspec.msgpack.encode(reply), media_type=MSGPACK)


class Feeds:
    """The front's pollers (see the module docstring); `hello` is the last reply's naming part."""

    def __init__(self, replicas: list, router: Router, client: httpx.AsyncClient, api_key: str | None = None):
        self.replicas, self.router, self.client = replicas, router, client
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.hello: FeedReply | None = None
        self.batches = [0] * len(replicas)  # batches applied, per replica
        self._tasks: list[asyncio.Task] = []
        self._decode = msgspec.msgpack.Decoder(FeedReply)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(r)) for r in self.replicas]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self, r) -> None:
        consumer, url = "", None
        while True:
            if not r.live or r.url != url:
                if consumer:
                    self.router.forget(r.index)
                consumer, url = "", r.url
                if not r.live:
                    await asyncio.sleep(POLL_S * 10)
                    continue
            consumer = consumer or uuid.uuid4().hex
            if not await self._poll(r, url, consumer):
                self.router.forget(r.index)
                consumer = ""
                await asyncio.sleep(RETRY_S)

    async def _poll(self, r, url: str, consumer: str) -> bool:
        """One poll applied; False when it failed (the replica's entries are then stale)."""
        try:
            resp = await self.client.get(
                url + FEED_PATH, params={"consumer": consumer}, headers=self.headers, timeout=WAIT_S + 10
            )
            if resp.status_code == 404:
                await asyncio.sleep(WAIT_S * 5)  # no prefix cache there: nothing will come
                return True
            if resp.status_code != 200:
                return False
            reply = self._decode.decode(resp.content)
        except (httpx.HTTPError, msgspec.DecodeError):
            return False
        if r.url != url or not r.live:
            return False
        self.hello = reply
        if reply.batch is not None:
            self.router.index.apply(r.index, reply.batch)
            self.batches[r.index] += 1
        return True
