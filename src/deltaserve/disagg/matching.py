"""An instance's answer to "what of this prompt do you hold?", both halves counted: the proxy asks
decode instances (which to send a request to) and prefill instances (which to compute it on).
The device hit and, read-only, how far a restore from the host or the disk tier would resume."""

from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Request

from ..server.async_engine import AsyncEngine
from .protocol import MatchReply, MatchRequest
from .service import read_msg, reply


def _match(core, ids: list[int]) -> MatchReply:
    if not core.cache.prefix_enabled or len(ids) < 2:
        return MatchReply(len(ids), 0, 0, len(core.scheduler.waiting))
    hit, unit = core.cache.lookup(ids), core.cache.policy.unit
    lower = core.cache.tier.resumable(list(hit.hashes), hit.k_mla)
    return MatchReply(
        len(ids),
        hit.length,
        hit.k_mla * unit,
        len(core.scheduler.waiting),
        lower.get("host", 0) * unit,
        lower.get("disk", 0) * unit,
    )


async def match_reply(engine: AsyncEngine, ids: list[int] | None) -> MatchReply:
    if ids is None:
        return MatchReply(0, 0, 0, engine.queue_load())
    return await engine.call(lambda core: _match(core, ids))


def add_match_route(r: APIRouter, engine: AsyncEngine, secret: str, render: Callable) -> None:
    """`POST /disagg/match` on `r`: `render(state, path, body)` gives a request's prompt ids (or None)."""

    @r.post("/disagg/match")
    async def match(request: Request):
        msg = await read_msg(request, secret, MatchRequest)
        ids = await render(request.app.state.server, msg.path, msg.body)
        return reply(await match_reply(engine, ids))
