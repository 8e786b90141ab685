"""A decode instance's answer to "what of this prompt do you hold?", both halves counted."""

from __future__ import annotations

from ..server.async_engine import AsyncEngine
from .protocol import MatchReply


def _match(core, ids: list[int]) -> MatchReply:
    if not core.cache.prefix_enabled or len(ids) < 2:
        return MatchReply(len(ids), 0, 0, len(core.scheduler.waiting))
    hit = core.cache.lookup(ids)
    return MatchReply(len(ids), hit.length, hit.k_mla * core.cache.policy.unit, len(core.scheduler.waiting))


async def match_reply(engine: AsyncEngine, ids: list[int] | None) -> MatchReply:
    if ids is None:
        return MatchReply(0, 0, 0, engine.queue_load())
    return await engine.call(lambda core: _match(core, ids))
