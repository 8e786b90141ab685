"""What a caller of `AsyncEngine` holds: a request's stream of `SeqDelta`s, and the errors the
engine side raises to it (`EngineDeadError`: the engine thread is not running; `GenerationError`:
a sequence finished with "error")."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ..engine.core.loop import SeqDelta


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shut down or crashed)."""


class GenerationError(RuntimeError):
    """A sequence finished with "error" (e.g. its structured-output grammar failed); the message
    is the engine's `stop_reason`, safe to show to the client."""


@dataclass
class RequestStream:
    """The outputs of one request: async-iterate for `SeqDelta`s until all `n` have finished."""

    engine: Any  # the AsyncEngine it came from (its `abort`)
    request_id: str
    n: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    remaining: int = 0
    done: bool = False
    observer: Any = None  # optional: `.on_delta(d)` per delta, `.aborted()` on an early abort

    def __post_init__(self):
        self.remaining = self.n

    def __aiter__(self):
        return self

    async def __anext__(self) -> SeqDelta:
        if self.remaining == 0:
            self.done = True
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finish_reason is not None:
            self.remaining -= 1
        if self.observer is not None:
            self.observer.on_delta(item)
        if item.finish_reason == "error":
            raise GenerationError(str(item.stop_reason or "generation failed"))
        return item

    def abort(self) -> None:
        """Abort unless finished (idempotent); call from `finally` around consumption."""
        if not self.done and self.remaining > 0:
            self.done = True
            self.engine.abort(self.request_id)
            if self.observer is not None:
                self.observer.aborted()
