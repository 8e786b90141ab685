"""`LockStepEngine`: the `AsyncEngine` of one replica server of `serve --data-parallel-size N
--enable-expert-parallel` (wide EP: attention data-parallel, the routed experts split over the N
replica servers, tokens exchanged by all-to-all).

Its engine thread runs rounds in step with the other replicas (`engine.core.lockstep.LockStep`):
messages first (waiting at most `IDLE_POLL` s when it has no work), then one all-reduce of (has
work, stopping); where any replica has work every replica runs one forward, a zero-token one if
it has nothing scheduled. A `Shutdown` stops every replica after the same round; a replica
stopped by another's shutdown, or whose round fails (a peer died: its collective times out after
`distributed_timeout`), fails as a dead rank does (the server exits), since the group cannot go
on without it.
"""

from __future__ import annotations

import logging

from ..engine.core.lockstep import LockStep
from ..engine.core.loop import EngineCore
from .async_engine import AsyncEngine

log = logging.getLogger(__name__)

IDLE_POLL = 0.02  # seconds an idle replica waits for a message between two rounds


class LockStepEngine(AsyncEngine):
    def __init__(self, core: EngineCore, family: str, chat_template: str | None = None):
        super().__init__(core, family, chat_template)
        self.lock = LockStep(core)

    def _loop(self) -> None:
        while True:
            running = self._drain(0 if self.core.scheduler.has_work() else IDLE_POLL)
            try:
                busy, stop = self.lock.sync(self.core.scheduler.has_work(), not running)
            except Exception as e:
                self._fatal(f"the expert-parallel group failed: {type(e).__name__}: {e}")
                return
            if stop:
                if running:
                    self._fatal("another expert-parallel replica stopped")
                return
            if not busy:
                continue
            try:
                deltas = self.lock.step(self.core.step_deltas)
            except Exception as e:  # the replicas are out of step now: nothing can go on
                log.exception("wide expert-parallel step failed")
                self._fatal(f"a wide expert-parallel step failed: {type(e).__name__}: {e}")
                return
            self._deliver(deltas)
