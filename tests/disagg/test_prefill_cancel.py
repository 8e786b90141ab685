"""The prefill role's `prefill` cancelled at any point (here: after the engine parked the prompt,
before the caller read it) frees the prompt: nothing stays parked outside the service's view."""

from __future__ import annotations

import asyncio
import time

import pytest

from deltaserve.disagg.prefill import PrefillService
from deltaserve.disagg.protocol import PrefillRequest
from tests.server.tiny_engine import tiny_async_engine


class NoTransfer:
    """One rank, nothing registered: this path never hashes (the caller leaves first)."""

    world, endpoints = 1, []

    async def digests(self, regions, timeout=300.0):
        return [[]]


@pytest.fixture
def engine(tmp_path):
    with tiny_async_engine(tmp_path) as eng:
        yield eng


def test_a_prefill_cancelled_after_parking_frees_the_prompt(engine):
    service = PrefillService(engine, NoTransfer(), "secret", ttl_s=60)
    core = engine.core

    async def main():
        task = asyncio.ensure_future(service.prefill(PrefillRequest("h1", list(range(5, 40)), 0)))
        await asyncio.sleep(0)
        deadline = time.time() + 20
        while not core.parked and time.time() < deadline:
            time.sleep(0.005)  # the event loop is held while the engine prefills and parks
        assert core.parked
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await engine.call(lambda c: (dict(c.parked), c.cache.usage()["kda_slots_used"], len(c.cache.seqs)))

    parked, slots, seqs = asyncio.run(main())
    assert parked == {} and slots == 0 and seqs == 0 and not service.parked
