"""Shutting a server down (`serve.stop_engine`): the other ranks are told to stop (`llm.shutdown`,
a broadcast on the control group) only once the engine thread has stopped; a thread still inside
a step at the deadline gets the workers killed instead, so no second thread ever broadcasts
while a step does (before the fix `serve` sent `Shutdown` after a join that may have timed out)."""

from __future__ import annotations

import threading

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.serve import stop_engine
from deltaserve.server.async_engine import AsyncEngine

from .tiny_engine import tiny_async_engine


class Ranks:
    """Stands in for the `LLM`: records each call and whether the engine thread was alive then."""

    def __init__(self, engine: AsyncEngine):
        self.engine, self.calls = engine, []

    def shutdown(self) -> None:
        self.calls.append(("shutdown", self.engine.alive))

    def kill(self) -> None:
        self.calls.append(("kill", self.engine.alive))


def _stepping(core, eng: AsyncEngine, rid: str) -> threading.Event:
    """Start `eng`'s thread on request `rid` in a step that waits for the returned event."""
    entered, release = threading.Event(), threading.Event()
    real = type(core).step_deltas

    def step(self):
        entered.set()
        release.wait(60)
        return real(self)

    core.step_deltas = step.__get__(core)
    core.add_request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0))  # before the thread
    eng.start()
    assert entered.wait(30), "the engine thread never stepped"
    return release


def test_ranks_are_told_to_stop_only_after_the_engine_thread_has(tmp_path):
    with tiny_async_engine(tmp_path) as first:
        core = first.core
        first.shutdown()
        eng = AsyncEngine(core, "kimi_linear")
        release = _stepping(core, eng, "a")
        ranks = Ranks(eng)
        threading.Timer(0.3, release.set).start()
        stop_engine(eng, ranks, timeout=30)
        assert ranks.calls == [("shutdown", False)]
        core.abort_request("a")

        stuck = AsyncEngine(core, "kimi_linear")
        release = _stepping(core, stuck, "b")
        ranks = Ranks(stuck)
        stop_engine(stuck, ranks, timeout=0.5)
        assert ranks.calls == [("kill", True)]  # never a broadcast beside the running step
        release.set()
        assert stuck.shutdown(30)
