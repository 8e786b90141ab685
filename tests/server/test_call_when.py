"""`AsyncEngine.call_when`: a call the engine thread retries after each step and message batch
until it returns something, in FIFO order, gated by its key; a caller that gives up gets None and
whatever it is handed too late is released; an engine that stops fails the waiters."""

from __future__ import annotations

import asyncio
import time

import pytest

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.server.request_stream import EngineDeadError

from .tiny_engine import tiny_async_engine


@pytest.fixture
def engine(tmp_path):
    with tiny_async_engine(tmp_path) as eng:
        yield eng


def test_waiters_are_served_in_order_once_they_can_be(engine):
    gate, tries, released = {"open": False}, [], []

    def fn(name):
        def attempt(core):
            tries.append(name)
            return name if gate["open"] else None

        return attempt

    async def main():
        first = asyncio.create_task(engine.call_when(fn("a"), lambda c, r: released.append(r), 30))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(engine.call_when(fn("b"), lambda c, r: released.append(r), 30))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        assert "b" not in tries  # the head blocks the queue behind it
        await engine.call(lambda core: gate.update(open=True))
        return await first, await second

    assert asyncio.run(main()) == ("a", "b")
    assert not released


def test_a_waiter_is_retried_only_when_its_key_changes(engine):
    """A running request steps the engine many times; the call runs again only on a new key."""
    key, tries = {"k": 0}, []

    def attempt(core):
        tries.append(key["k"])
        return "done" if key["k"] == 2 else None

    async def main():
        stream = await engine.add(list(range(5, 20)), SamplingParams(max_tokens=40, ignore_eos=True))
        waiting = asyncio.create_task(engine.call_when(attempt, lambda c, r: None, 30, key=lambda core: key["k"]))
        steps = 0
        async for _ in stream:
            steps += 1
            if steps == 10:
                await engine.call(lambda core: key.update(k=1))
            if steps == 20:
                await engine.call(lambda core: key.update(k=2))
        return await waiting, steps

    got, steps = asyncio.run(main())
    assert got == "done" and steps == 40
    assert tries == [0, 1, 2]


def test_a_caller_that_gives_up_gets_none_and_a_late_result_is_released(engine):
    released, tries = [], []

    def never(core):
        tries.append(1)
        return None

    def slow(core):
        time.sleep(0.6)  # the caller's timeout passes while the engine thread is in here
        return "late"

    async def main():
        assert await engine.call_when(never, lambda c, r: released.append(r), 0.1) is None
        n = len(tries)
        await engine.call(lambda core: None)
        await engine.call(lambda core: None)
        assert len(tries) == n  # dropped from the queue: never tried again
        assert await engine.call_when(slow, lambda c, r: released.append(r), 0.2) is None
        await engine.call(lambda core: None)  # behind the drop message

    asyncio.run(main())
    assert released == ["late"]


def test_a_stopping_engine_fails_its_waiters(engine):
    async def main():
        waiting = asyncio.create_task(engine.call_when(lambda core: None, lambda c, r: None, 30))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            await waiting
        with pytest.raises(EngineDeadError):
            await engine.call_when(lambda core: "x", lambda c, r: None, 1)

    asyncio.run(main())


def test_a_call_given_up_before_it_ran_is_skipped_and_the_engine_goes_on(engine):
    ran = []

    async def main():
        busy = asyncio.ensure_future(engine.call(lambda core: time.sleep(0.5)))
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await engine.call(lambda core: ran.append("late"), timeout=0.05)
        await busy
        return await engine.call(lambda core: "served", timeout=5)

    assert asyncio.run(main()) == "served"
    assert engine.alive and engine.failure is None and ran == []


def test_a_running_call_whose_caller_left_is_released(engine):
    released = []

    def slow(core):
        time.sleep(0.3)
        return "slot"

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await engine.call(slow, timeout=0.1, release=lambda core, r: released.append(r))
        await engine.call(lambda core: None)  # queued behind the release
        await engine.call(lambda core: None)

    asyncio.run(main())
    assert released == ["slot"] and engine.alive


def test_an_error_in_the_loop_stops_the_engine_loudly(engine, monkeypatch):
    reasons = []
    engine.on_failure(reasons.append)

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.core.scheduler, "has_work", broken)
    engine.post(lambda core: None)  # wake the loop
    deadline = time.time() + 10
    while engine.alive and time.time() < deadline:
        time.sleep(0.02)
    assert not engine.alive and "boom" in (engine.failure or "") and reasons and "boom" in reasons[0]
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.call(lambda core: None))


def test_an_add_cancelled_before_the_engine_took_it_queues_nothing(engine):
    params = SamplingParams(max_tokens=2, temperature=0)

    async def main():
        busy = asyncio.ensure_future(engine.call(lambda core: time.sleep(0.5)))
        await asyncio.sleep(0.05)
        add = asyncio.ensure_future(engine.add([5, 6, 7], params, "gone"))
        await asyncio.sleep(0.05)
        add.cancel()
        with pytest.raises(asyncio.CancelledError):
            await add
        await busy
        queued = await engine.call(lambda core: core.has_unfinished() or "gone" in core.requests)
        stream = await engine.add([5, 6, 7], params, "kept")
        return queued, [d async for d in stream]

    queued, deltas = asyncio.run(main())
    assert not queued and deltas and engine.alive and engine.failure is None


def test_an_add_cancelled_after_the_engine_took_it_is_aborted(engine):
    params = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)

    async def main():
        before = await engine.call(lambda core: core.counters["requests_aborted"])
        add = asyncio.ensure_future(engine.add([5, 6, 7], params, "orphan"))
        await asyncio.sleep(0)  # the AddRequest is queued
        time.sleep(0.3)  # the event loop is busy; the engine thread takes the request meanwhile
        add.cancel()
        with pytest.raises(asyncio.CancelledError):
            await add
        return before, await engine.call(lambda core: (core.counters["requests_aborted"], "orphan" in core.requests))

    before, (after, running) = asyncio.run(main())
    assert after == before + 1 and not running and engine.alive


def test_what_arrives_as_the_engine_stops_is_refused(engine):
    async def main():
        engine.fail("stopped by the test")
        add = engine.add([5, 6, 7], SamplingParams(max_tokens=2), "late")
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(add, 5)

    asyncio.run(main())
    engine._thread.join(10)  # the thread fails the late request, then ends: wait for the end
    assert engine.failure == "stopped by the test" and not engine.alive


def test_a_posted_call_that_fails_is_logged(engine, caplog):
    engine.post(lambda core: 1 / 0)
    asyncio.run(engine.call(lambda core: None))  # behind the posted one
    assert any("posted to the engine thread failed" in r.getMessage() for r in caplog.records)
    assert engine.alive
