"""One data-parallel engine replica: `python -m deltaserve.engine.dp.replica`, spawned by the
offline `LLM`'s client (engine/dp/client.py) with its config (JSON) and the descriptor of its
end of a socket pair in the `DELTASERVE_DP_REPLICA` environment variable.

It builds a whole engine with `build_engine` (its own scheduler, caches and, with
`tensor_parallel_size > 1`, its own worker ranks), answers `Ready`, then serves the client's
`dp_protocol` messages: between two steps it handles every message waiting, and it steps while
it has unfinished requests (a wide expert-parallel replica: while any replica has, in lock-step
with them, `serve_lockstep`). With the prefix cache on it publishes `CacheEvents` (`cache.events`)
after each step or call that changed what can resume here (and while idle, what its disk tier
wrote), the first one a reset. It exits 0 on `Shutdown`, 1 after telling the client `Failed`
(any error), when the client closes the socket, or when its parent process is gone. It ignores
SIGINT: a Ctrl-C reaches the whole process group, and interrupting is the client's to handle
(it aborts the call's requests and the replicas go on).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time

import msgspec

from ... import env
from ...cache.events import EventLog, publish
from ..core.builder import Engine, build_engine
from ..core.lockstep import LockStep
from ..exec.ranks import config_from_json, exit_with_parent
from ..request.sequence import InvalidRequestError
from .protocol import (
    DP_PROTOCOL_VERSION,
    HEARTBEAT,
    Abort,
    Add,
    Added,
    Call,
    Failed,
    Link,
    Outputs,
    Ready,
    Result,
    Shutdown,
    ToReplica,
    image_from_wire,
    params_from_wire,
)

log = logging.getLogger(__name__)

IDLE_POLL = 0.02  # seconds an idle wide-EP replica waits for a message between two lock-step rounds

REPLICA_ENV = env.DP_REPLICA.name


class Replica:
    def __init__(self, engine: Engine, link: Link):
        self.engine, self.core, self.link = engine, engine.core, link
        self.lock = LockStep(self.core) if engine.model.tp.ep_world > 1 else None
        self.events = None
        if engine.cache.prefix_enabled:
            self.events = EventLog()
            publish(engine.cache, self.events)

    def publish(self) -> None:
        batch = self.events.drain() if self.events is not None else None
        if batch is not None:
            self.link.send(batch)

    def ready(self) -> Ready:
        e = self.engine
        return Ready(
            DP_PROTOCOL_VERSION,
            e.max_model_len,
            e.model.config.vocab_size,
            e.model.config.family,
            e.core.image_prompts.pad_id,
            e.core.runner.encoder is not None,
            e.rank_memory,
            e.cache.model_id if e.cache.prefix_enabled else "",
            e.cache.policy.unit if e.cache.prefix_enabled else 0,
        )

    def serve(self) -> None:
        """Messages and steps until `Shutdown` (returns) or an error (raises)."""
        if self.lock is not None:
            return self.serve_lockstep()
        last = time.monotonic()
        while True:
            busy = self.core.has_unfinished()
            if self.link.ready(0 if busy else HEARTBEAT if self.events is not None else None):
                msg = self.link.recv()
                if isinstance(msg, Shutdown):
                    return
                self.handle(msg)
                continue
            if not busy:  # idle: what the disk tier's writer did meanwhile
                self.publish()
                continue
            if not self.core.scheduler.has_work():
                raise RuntimeError("engine idle with unfinished requests")
            outs = self.core.step()
            self.publish()
            now = time.monotonic()
            if outs or now - last >= HEARTBEAT:
                self.link.send(Outputs(outs))
                last = now

    def serve_lockstep(self) -> None:
        """Wide EP: between two rounds every waiting message, then a round with the other replicas
        (`LockStep`): a step (or zero-token forward) where any has work; all stop together once
        one got `Shutdown`; an idle round waits `IDLE_POLL` s for a message."""
        last, stop = time.monotonic(), False
        while True:
            while not stop and self.link.ready(0):
                msg = self.link.recv()
                stop = isinstance(msg, Shutdown)
                if not stop:
                    self.handle(msg)
            busy, stopping = self.lock.sync(self.core.has_unfinished(), stop)
            if stopping:
                return
            if not busy:
                self.publish()
                self.link.ready(IDLE_POLL)
                continue
            if self.core.has_unfinished() and not self.core.scheduler.has_work():
                raise RuntimeError("engine idle with unfinished requests")
            outs = self.lock.step()
            self.publish()
            now = time.monotonic()
            if outs or now - last >= HEARTBEAT:
                self.link.send(Outputs(outs))
                last = now

    def handle(self, msg) -> None:
        if isinstance(msg, Add):
            self.link.send(self.add(msg))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                self.core.abort_request(rid)
        elif isinstance(msg, Call):
            result = self.call(msg.seq, msg.name)
            self.publish()
            self.link.send(result)

    def add(self, msg: Add) -> Added:
        """Validate the whole batch, then queue it; on a refusal nothing of it stays queued."""
        staged = []
        for i, r in enumerate(msg.requests):
            try:
                params = params_from_wire(r.params)
                images = None if r.images is None else [image_from_wire(w) for w in r.images]
                self.core.validate(r.request_id, r.prompt_token_ids, params, images)
            except ValueError as e:  # InvalidRequestError, or a malformed image / params
                return Added(msg.seq, str(e), i, 0)
            staged.append((r, params, images))
        for i, (r, params, images) in enumerate(staged):
            try:
                self.core.add_request(
                    r.request_id, r.prompt_token_ids, params, prompt=r.prompt, cache_salt=r.cache_salt, images=images
                )
            except InvalidRequestError as e:
                for done, *_ in staged[:i]:
                    self.core.abort_request(done.request_id)
                return Added(msg.seq, str(e), i, 1)
        return Added(msg.seq)

    def call(self, seq: int, name: str) -> Result:
        try:
            if name == "stats":
                value = self.core.stats()
            elif name == "reset_prefix_cache":
                value = self.engine.cache.reset_prefix_cache()
            elif name == "check_integrity":
                value = self.engine.cache.check_integrity()
            else:
                raise ValueError(f"unknown call {name!r}")
            return Result(seq, msgspec.to_builtins(value))
        except Exception as e:
            return Result(seq, error=f"{type(e).__name__}: {e}")


def _tell(link: Link, msg) -> None:
    try:
        link.send(msg)
    except OSError:
        pass


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's: it aborts its requests
    spec = json.loads(os.environ.pop(REPLICA_ENV))
    exit_with_parent()  # and so its worker ranks, which watch it alike
    link = Link(socket.socket(fileno=spec["fd"]), ToReplica)
    try:
        engine = build_engine(config_from_json(spec["config"]))
    except Exception as e:
        log.exception("data-parallel replica %s failed to start", spec["index"])
        _tell(link, Failed(f"start-up: {type(e).__name__}: {e}"))
        return 1
    try:
        replica = Replica(engine, link)
        link.send(replica.ready())
        replica.publish()  # what the tiers hold after a restart (the disk tier's objects)
        replica.serve()
        return 0
    except (EOFError, ConnectionError):
        log.error("data-parallel replica %s: the client is gone", spec["index"])
        return 1
    except Exception as e:
        log.exception("data-parallel replica %s failed", spec["index"])
        _tell(link, Failed(f"{type(e).__name__}: {e}"))
        return 1
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
