"""`AsyncEngine`: the `EngineCore` step loop on one background thread, driven from asyncio.

The engine thread is the only one that touches the core. The event loop side talks to it only
through typed messages on a thread-safe queue (`AddRequest`, `AbortRequest`, `Call`, `Shutdown`);
replies come back on `concurrent.futures.Future`s, and each request's `SeqDelta`s are pushed
into its own `asyncio.Queue` with `loop.call_soon_threadsafe`. A request that is dropped before
it finishes (client disconnect, cancelled task) sends `AbortRequest`, which frees its cache.
A structured request's grammar is compiled on a worker thread before it is queued (`add`), so
neither the event loop nor the engine thread waits on a slow schema; a sequence the engine
finishes with "error" (its grammar failed) makes its stream raise `GenerationError`.
`call_when` queues a call that the engine thread retries after each step and message batch until
it returns something (a disaggregated decode instance waiting for a free slot), FIFO.
Callers that leave never leave work behind: a `call` or `add` whose caller gave up (timeout,
cancellation) before the engine thread reached it is skipped; a call already running completes
and hands its result to its `release`, if any; an add already taken is aborted. What arrives as
the thread stops is refused (`EngineDeadError`), never left waiting, and an error that escapes
the loop itself stops the engine as a fatal failure, never silently.
A request's images (`ImageInput`s, one per `<|media_pad|>` run of its prompt, in order) travel with
its `AddRequest` to `EngineCore.add_request(..., images=...)`; an engine whose `add_request`
takes no `images` or that has no vision tower (`accepts_images` False) refuses them with
`InvalidRequestError`.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import queue
import threading
import uuid
from concurrent.futures import Future
from typing import Any, Callable

from ..engine.core.loop import EngineCore
from ..engine.exec.ranks import RankFailure
from ..engine.request.multimodal import ImageInput
from ..engine.request.sampling_params import SamplingParams
from ..engine.request.sequence import InvalidRequestError
from .engine_messages import AbortRequest, AddRequest, Call, Fatal, Shutdown, StartWaiting, StopWaiting, Waiter
from .request_stream import EngineDeadError, RequestStream

log = logging.getLogger(__name__)


class AsyncEngine:
    """Owns an `EngineCore` on a daemon thread; `family` and `chat_template` describe the
    checkpoint for the chat routes."""

    def __init__(self, core: EngineCore, family: str, chat_template: str | None = None):
        self.core = core
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.vocab_size = core.model.config.vocab_size
        self.family = family
        self.chat_template = chat_template
        self.accepts_images = (  # images need the engine's support and a loaded vision tower
            "images" in inspect.signature(core.add_request).parameters
            and getattr(getattr(core, "runner", None), "encoder", None) is not None
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `_send` against the thread's final look at the inbox
        self._stopped = False
        self._sinks: dict[str, Callable] = {}
        self._waiters: collections.deque[Waiter] = collections.deque()
        self._thread: threading.Thread | None = None
        self.failure: str | None = None  # why the engine stopped on its own, if it did
        self._on_failure: list[Callable[[str], None]] = []
        # queue-size estimate readable from the event loop without touching the core: the
        # engine thread publishes len(scheduler.waiting) (an int store is atomic); `pending`
        # counts adds sent but not yet accepted (event-loop side only)
        self.num_waiting = 0
        self.pending = 0

    # ------------------------------------------------------------ control (any thread)

    def on_failure(self, fn: Callable[[str], None]) -> None:
        """Call `fn(reason)` (from the engine thread) if the engine stops on a fatal error."""
        self._on_failure.append(fn)

    def start(self) -> None:
        ranks = getattr(self.core.runner, "ranks", None)
        if ranks is not None:
            ranks.on_failure(lambda reason: self._send(Fatal(reason), quiet=True))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
            self._thread.start()

    def fail(self, reason: str) -> None:
        """Stop the engine as failed (`reason` logged, `on_failure` called, requests failed) once
        the engine thread reaches this, after what was queued before it."""
        self._send(Fatal(reason), quiet=True)

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread after its current step; True once it has stopped (False: still
        inside a step after `timeout` seconds)."""
        if self._thread is not None and self._thread.is_alive():
            self._send(Shutdown(), quiet=True)
            self._thread.join(timeout)
        return not self.alive

    def queue_load(self) -> int:
        """Requests waiting in the scheduler plus those on their way in."""
        return self.num_waiting + self.pending

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id), quiet=True)

    def call_sync(self, fn: Callable[[EngineCore], Any], timeout: float = 30.0) -> Any:
        """`fn(core)` evaluated on the engine thread; blocks the calling (non-loop) thread."""
        return self._call(fn).result(timeout)

    def post(self, fn: Callable[[EngineCore], Any]) -> None:
        """Run `fn(core)` on the engine thread without waiting (cleanup from a cancelled task);
        an error it raises is logged."""
        if self.alive:
            fut: Future = Future()
            fut.add_done_callback(_log_posted_failure)
            self._send(Call(fn, fut), quiet=True)

    async def call(
        self,
        fn: Callable[[EngineCore], Any],
        timeout: float = 30.0,
        release: Callable[[EngineCore, Any], None] | None = None,
    ) -> Any:
        """`fn(core)` on the engine thread. If the caller stops waiting (`timeout`, cancellation)
        before the engine thread took the call, it never runs; if after, its result goes to
        `release(core, result)` on the engine thread."""
        fut = self._call(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            if release is not None:
                fut.add_done_callback(lambda f: self._release_late(f, release))
            raise

    def _release_late(self, f: Future, release: Callable[[EngineCore, Any], None]) -> None:
        if not f.cancelled() and f.exception() is None:
            self.post(lambda core: release(core, f.result()))

    async def call_when(
        self,
        fn: Callable[[EngineCore], Any],
        release: Callable[[EngineCore, Any], None],
        timeout: float,
        key: Callable[[EngineCore], Any] | None = None,
    ) -> Any:
        """`fn(core)` on the engine thread, retried after every step and batch of messages until it
        returns non-None, behind the calls queued here before it (FIFO); with `key`, retried only
        when `key(core)` changed since the last try. None after `timeout` s; a result that comes
        too late (or to a cancelled caller) goes to `release(core, result)` on the engine thread."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        waiter = Waiter(fn, release, Future(), key)
        self._send(StartWaiting(waiter))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(waiter.result)), timeout)
        except asyncio.TimeoutError:
            self._send(StopWaiting(waiter), quiet=True)
            return None
        except asyncio.CancelledError:
            self._send(StopWaiting(waiter), quiet=True)
            raise

    def _send(self, msg, quiet: bool = False) -> None:
        """Queue `msg` for the engine thread. Once the thread has stopped, nothing is queued (it
        would never be answered): `EngineDeadError`, or nothing with `quiet`."""
        with self._lock:
            if not self._stopped:
                self._inbox.put(msg)
                return
        if not quiet:
            raise EngineDeadError("the engine is not running")

    def _call(self, fn) -> Future:
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        fut: Future = Future()
        self._send(Call(fn, fut))
        return fut

    async def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        images: list[ImageInput] | None = None,
        **options,
    ) -> RequestStream:
        """Queue a request (with its `images`, one per `<|media_pad|>` run of `prompt_ids`); raises
        the core's validation error (`InvalidRequestError`) before anything is queued, else
        returns its stream."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if images and not self.accepts_images:
            raise InvalidRequestError("this engine cannot take images")
        if params.structured is not None:
            await asyncio.to_thread(self.core.precompile, params)
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id or uuid.uuid4().hex, params.n)

        def sink(item, q=stream.queue):
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

        accepted: Future = Future()
        self.pending += 1
        try:
            self._send(
                AddRequest(
                    stream.request_id,
                    list(prompt_ids),
                    params,
                    sink,
                    accepted,
                    tuple(images or ()),
                    tuple(options.items()),
                )
            )
            try:
                await asyncio.wrap_future(accepted)
            except asyncio.CancelledError:
                if not accepted.cancelled():  # the engine took it first: nobody owns it now
                    self.abort(stream.request_id)
                raise
        finally:
            self.pending -= 1
        return stream

    # ------------------------------------------------------------ the engine thread

    def _handle(self, msg) -> bool:
        """Apply one message; False on Shutdown."""
        if isinstance(msg, AddRequest):
            if not msg.accepted.set_running_or_notify_cancel():
                return True  # its caller left before it was queued: queue nothing
            kw = {"images": list(msg.images)} if msg.images else {}
            kw.update(msg.options)
            try:
                self.core.add_request(msg.request_id, msg.prompt_ids, msg.params, **kw)
            except Exception as e:  # validation: report to the caller, queue nothing
                msg.accepted.set_exception(e)
            else:
                self._sinks[msg.request_id] = msg.sink
                self.num_waiting = len(self.core.scheduler.waiting)
                msg.accepted.set_result(None)
        elif isinstance(msg, AbortRequest):
            if self._sinks.pop(msg.request_id, None) is not None:
                self.core.abort_request(msg.request_id)
        elif isinstance(msg, Call):
            if not msg.result.set_running_or_notify_cancel():
                return True  # its caller gave up before it ran
            try:
                value = msg.fn(self.core)
            except Exception as e:
                msg.result.set_exception(e)
            else:
                msg.result.set_result(value)
        elif isinstance(msg, StartWaiting):
            self._waiters.append(msg.waiter)
        elif isinstance(msg, StopWaiting):
            self._stop_waiting(msg.waiter)
        elif isinstance(msg, Shutdown):
            return False
        elif isinstance(msg, Fatal):
            self._fatal(msg.reason)
            return False
        return True

    def _serve_waiters(self) -> None:
        """Try the queued calls in order; stop at the first that returns None (or whose key has
        not changed since it did)."""
        while self._waiters:
            w = self._waiters[0]
            if w.key is not None:
                seen, w.seen = w.seen, w.key(self.core)
                if seen is not None and seen == w.seen:
                    return
            try:
                got = w.fn(self.core)
            except Exception as e:
                self._waiters.popleft()
                w.result.set_exception(e)
                continue
            if got is None:
                return
            self._waiters.popleft()
            w.result.set_result(got)

    def _stop_waiting(self, w: Waiter) -> None:
        """Drop a waiter whose caller gave up; release what it was given if it was served."""
        try:
            self._waiters.remove(w)
        except ValueError:
            if w.result.done() and w.result.exception() is None and w.result.result() is not None:
                w.release(self.core, w.result.result())

    def _fatal(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("engine stopped: %s", reason)
            for fn in self._on_failure:
                fn(reason)

    def _fail_all(self, err: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            self.core.abort_request(rid)
            sink(err)
        self._sinks.clear()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # a bug in the loop itself: fail loudly, as a dead rank does
            log.exception("the engine thread failed")
            self._fatal(f"the engine thread failed: {type(e).__name__}: {e}")
        while self._waiters:
            self._waiters.popleft().result.set_exception(EngineDeadError("the engine stopped"))
        self._fail_all(
            EngineDeadError(f"the engine failed: {self.failure}" if self.failure else "the engine was shut down")
        )
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Answer what was queued behind the stop (an add or call arriving as it stopped); then
        nothing more is queued (`_send`)."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            fut = getattr(msg, "accepted", None) or getattr(msg, "result", None)
            if isinstance(msg, StartWaiting):
                fut = msg.waiter.result
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError("the engine stopped"))

    def _drain(self, wait: float | None) -> bool:
        """Handle every queued message, first waiting up to `wait` s for one (None: until one
        comes; 0: not at all); False once a `Shutdown` (or `Fatal`) stopped the loop."""
        try:
            msg = self._inbox.get_nowait() if wait == 0 else self._inbox.get(timeout=wait)
        except queue.Empty:
            msg = None
        while msg is not None:
            if not self._handle(msg):
                return False  # what follows is refused (`_refuse_queued`), not dropped
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                msg = None
        self._serve_waiters()
        self.num_waiting = len(self.core.scheduler.waiting)
        return True

    def _deliver(self, deltas) -> None:
        """A step's deltas to their requests' sinks; finished requests' sinks dropped."""
        for d in deltas:
            sink = self._sinks.get(d.request_id)
            if sink is not None:
                sink(d)
        for rid in [r for r in self._sinks if r not in self.core.requests]:
            del self._sinks[rid]
        self._serve_waiters()
        self.num_waiting = len(self.core.scheduler.waiting)

    def _loop(self) -> None:
        while self._drain(0 if self.core.scheduler.has_work() else None):
            if not self.core.scheduler.has_work():
                if self._sinks:
                    self._fail_all(RuntimeError("the engine cannot schedule the remaining requests"))
                continue
            try:
                deltas = self.core.step_deltas()
            except RankFailure as e:
                self._fatal(str(e))
                break
            except Exception:
                log.exception("engine step failed; aborting the running requests")
                self._fail_all(RuntimeError("internal engine error"))
                continue
            self._deliver(deltas)


def _log_posted_failure(f: Future) -> None:
    if not f.cancelled() and f.exception() is not None:
        log.error("a call posted to the engine thread failed", exc_info=f.exception())
