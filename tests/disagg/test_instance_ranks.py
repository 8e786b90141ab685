"""`InstanceRanks` over one rank: reads and hashes run as jobs beside the engine thread; a
caller cancelled mid-read leaves the job's collection posted ahead of anything it posts next
(the reservation it frees must not take late bytes), and that collection waits for the bytes; a
read still running at its deadline stops the instance (its bytes could land in freed cache)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from deltaserve.disagg.ranks import InstanceRanks
from deltaserve.engine.exec.messages import RankRead
from deltaserve.engine.exec.rank_transfer import RankTransfer
from deltaserve.parallel.kv_transfer import Connector, TransferError


class SlowConnector(Connector):
    name, session = "slow", "slow:0"

    def __init__(self, seconds: float, hang: threading.Event | None = None):
        self.seconds, self.landed, self.hang = seconds, threading.Event(), hang

    def register(self, tensors):
        return {k: t.data_ptr() for k, t in tensors.items()}

    def read(self, session, remote, local) -> int:
        time.sleep(self.seconds)
        if self.hang is not None:
            self.hang.wait()
        self.landed.set()
        return sum(n for _, n in remote)


class InlineEngine:
    """Runs every call at once on the caller's thread (the engine thread's order, trivially)."""

    alive = True

    def __init__(self, core):
        self.core, self.posted, self.failures = core, [], []

    def fail(self, reason: str) -> None:
        self.failures.append(reason)

    async def call(self, fn, timeout=30.0, release=None):
        return fn(self.core)

    def post(self, fn):
        self.posted.append(fn(self.core))


def _ranks(seconds: float, hang=None) -> tuple[InstanceRanks, RankTransfer, SlowConnector]:
    connector = SlowConnector(seconds, hang)
    transfer = RankTransfer(connector, {"mla": torch.arange(64, dtype=torch.uint8)})
    ranks = object.__new__(InstanceRanks)  # the transfer made here, not by `setup_transfer`
    ranks.engine = InlineEngine(SimpleNamespace(runner=SimpleNamespace(channel=None, journal=None, transfer=transfer)))
    ranks.world, ranks._jobs = 1, itertools.count(1)
    return ranks, transfer, connector


def test_reads_and_digests_are_collected_jobs():
    ranks, transfer, _ = _ranks(0.0)
    regions = [("mla", 0, 0, 5, -1), ("mla", 0, 8, 7, -1)]
    assert asyncio.run(ranks.read([[RankRead("s", [(0, 5), (10, 7)], regions)]])) == 12
    assert asyncio.run(ranks.digests(regions)) == [transfer.digests(regions).digests]
    assert not transfer._jobs and not ranks.engine.posted


def test_a_cancelled_read_is_collected_before_anything_posted_after_it():
    ranks, transfer, connector = _ranks(0.4)

    async def main():
        task = asyncio.ensure_future(ranks.read([[RankRead("s", [(0, 8)], [("mla", 0, 0, 8, -1)])]]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ranks.engine.post(lambda core: connector.landed.is_set())  # what the caller posts next

    asyncio.run(main())
    collected, landed_before_next = ranks.engine.posted
    assert [r.moved for r in collected] == [8] and landed_before_next and not transfer._jobs


def test_a_region_outside_the_pools_is_refused_not_written():
    ranks, transfer, connector = _ranks(0.0)
    for region in [("mla", 0, 60, 8, -1), ("mla", 0, -1, 2, -1), ("states", 0, 0, 4, 0)]:
        receipt = transfer.read([RankRead("s", [(0, region[3])], [region])])
        assert "outside" in receipt.error and not connector.landed.is_set()


def test_device_pools_are_refused_by_a_host_only_transfer_engine():
    from deltaserve.parallel.kv_transfer import MooncakeConnector, _host_memory_only

    from .pd_fixtures import need_mooncake

    need_mooncake()
    if not _host_memory_only():
        pytest.skip("the installed Mooncake build reads device memory")
    with pytest.raises(TransferError, match="host memory only"):
        MooncakeConnector("127.0.0.1").register({"mla": torch.empty(16, device="meta")})


def test_a_hung_read_stops_the_instance_instead_of_hanging():
    hang = threading.Event()
    ranks, transfer, _ = _ranks(0.0, hang)
    try:
        with pytest.raises(TransferError, match="ran past"):
            asyncio.run(ranks.read([[RankRead("s", [(0, 8)], [("mla", 0, 0, 8, -1)])]], timeout=0.3))
        assert len(ranks.engine.failures) == 1 and "may still land" in ranks.engine.failures[0]
        assert not ranks.engine.posted  # nothing waits on the hung job
    finally:
        hang.set()


def test_the_engine_keeps_stepping_while_a_read_runs(tmp_path):
    """A read is a job beside the engine thread: a request submitted after it finishes first."""
    from deltaserve.cache.handoff import pool_tensors
    from deltaserve.engine.request.sampling_params import SamplingParams
    from tests.server.tiny_engine import tiny_async_engine

    with tiny_async_engine(tmp_path) as engine:
        core = engine.core
        connector = SlowConnector(1.5)
        core.runner.transfer = RankTransfer(connector, pool_tensors(core.cache.mla, core.cache.kda))
        ranks = object.__new__(InstanceRanks)
        ranks.engine, ranks.world, ranks._jobs = engine, 1, itertools.count(1)

        async def main():
            read = asyncio.ensure_future(ranks.read([[RankRead("s", [(0, 64)], [("mla", 0, 0, 64, -1)])]]))
            await asyncio.sleep(0.1)
            stream = await engine.add([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            deltas = [d async for d in stream]
            generated_while_reading = not connector.landed.is_set()
            return deltas, generated_while_reading, await read

        deltas, generated_while_reading, moved = asyncio.run(main())
    assert deltas and generated_while_reading and moved == 64
