"""The typed messages the event loop sends `AsyncEngine`'s engine thread (its inbox), and the
waiter record of `AsyncEngine.call_when`. Replies travel on `concurrent.futures.Future`s."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.core.loop import EngineCore, SeqDelta
from ..engine.request.multimodal import ImageInput
from ..engine.request.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[SeqDelta | BaseException], None]
    accepted: Future
    images: tuple[ImageInput, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()  # further `add_request` keywords (handoffs)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Call:
    """Run `fn(core)` on the engine thread between steps (stats, integrity checks)."""

    fn: Callable[[EngineCore], Any]
    result: Future


@dataclass(eq=False)
class Waiter:
    """A call retried on the engine thread until it returns non-None (`AsyncEngine.call_when`)."""

    fn: Callable[[EngineCore], Any]
    release: Callable[[EngineCore, Any], None]
    result: Future
    key: Callable[[EngineCore], Any] | None = None
    seen: Any = None


@dataclass(frozen=True)
class StartWaiting:
    waiter: Waiter


@dataclass(frozen=True)
class StopWaiting:
    waiter: Waiter


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Fatal:
    """The engine cannot go on (a tensor-parallel rank failed): stop, failing every request."""

    reason: str
