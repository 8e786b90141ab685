"""`deltaserve serve --data-parallel-size N`: N engine replicas behind one OpenAI-compatible front.

Each replica is a whole `deltaserve serve` (its own scheduler, caches and tensor-parallel ranks)
started as a subprocess on a loopback port with the same flags; the front forwards every API
request (streams relayed as they come, the client's `Authorization` passed on) to the replica an
`engine.dp.routing.Router` picks:
- **resumable prefix**: each replica publishes where a prefix can resume (MLA pages and a KDA
  checkpoint at a boundary, per tier: `server/cache_feed.py`); the front hashes the request's
  prompt as the replica will (`server/route_prompt.py`) and sends it where the longest prefix
  resumes, device over host over disk, minus load (requests in flight there);
- **session affinity**: a request naming `prompt_cache_key` (else `cache_salt`) stays on the
  replica its session went to, unless that one is `SPILL` requests busier than the least loaded;
- **prefix-affine fallback**: with nothing resumable anywhere, the routing key is the start of
  the prompt (a chat's messages before the last), hashed against each replica (rendezvous
  hashing), unless that replica has `SPILL` more requests in flight than the least loaded one.

Replicas are started, watched and restarted by `replica_supervisor.py`; the front routes only to
live ones (a key whose replica is down moves to its next rendezvous choice, and back when it
returns). A request whose replica could not be reached goes to another live one; one in flight on
a replica that dies fails with a 502 naming the death (a stream already answering ends with an SSE
error event and `[DONE]`); with no replica live the front answers 503. `/health` is the front's;
`/ready` is 200 while at least one replica is live and ready (its body counts them); `/metrics`
counts requests per replica, routing decisions by reason, the boundaries the front knows each
replica holds, live replicas, restarts and failures, and each replica's own metrics are at
`/replicas/{i}/metrics`. A dead or restarted replica's published entries are forgotten. Stopping
the front stops the replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from .engine.dp.routing import REASONS, Router
from .server.cache_feed import Feeds
from .server.errors import APIError
from .server.middleware import front_app
from .server.protocol import MAX_BODY_BYTES
from .server.relay import passed_headers, ready_flags, stream_back
from .server.replica_supervisor import Replica
from .server.route_prompt import PromptHasher, session_of

__all__ = ["Front", "Replica", "build_front_app", "replica_argv", "routing_key"]

KEY_BYTES = 2048  # prompt bytes the routing key hashes
FORWARDED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
FRONT_ONLY = ("--data-parallel-size", "--port", "--host", "--replica-start-timeout")
FAILURE_REASONS = ("exited", "start_timeout")


def routing_key(body: dict) -> bytes:
    """The start of the shared part of a request's prompt (see the module docstring)."""
    if isinstance(body.get("messages"), list):
        messages = body["messages"]
        prompt = messages[:-1] if len(messages) > 1 else messages
    else:
        prompt = body.get("prompt", "")
    salt = body.get("cache_salt") or ""
    return (json.dumps(salt) + json.dumps(prompt, sort_keys=True, default=str)).encode()[:KEY_BYTES]


class Unreached(APIError):
    """The replica could not be connected to: the request was not sent, another may take it."""


def _ended(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


async def death(proc: subprocess.Popen, wait: float = 1.0) -> str | None:
    """How `proc` ended, if it does within `wait` s (a killed process's connections close a moment
    before it can be reaped); None while it runs."""
    for _ in range(max(1, int(wait / 0.05))):
        if proc.poll() is not None:
            return _ended(proc.returncode)
        await asyncio.sleep(0.05)
    return None


class Front:
    def __init__(self, replicas: list[Replica], hasher: PromptHasher | None = None, api_key: str | None = None):
        """`hasher` None: no prompt hashes (routing by session and the fallback only)."""
        self.replicas, self.hasher = replicas, hasher
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self.router = Router()
        self.feeds = Feeds(replicas, self.router, self.client, api_key)

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.live]

    def pick(self, key: bytes, skip: set[int] = frozenset(), hashes=(), session: str | None = None) -> Replica:
        """The live replica the router picks (see the module docstring); 503 when none is live
        (but those in `skip`)."""
        live = [r.index for r in self.live() if r.index not in skip]
        if not live:
            raise self.unavailable(len(self.live()))
        loads = [r.inflight for r in self.replicas]
        return self.replicas[self.router.route(key, hashes, loads, live, session).replica]

    def unavailable(self, live: int) -> APIError:
        n = len(self.replicas)
        why = "they are being restarted" if not live else f"the {live} live did not answer"
        return APIError(
            503,
            f"no data-parallel replica could take the request ({live} of {n} live; {why})",
            "service_unavailable",
            headers={"Retry-After": "1"},
        )

    async def forward(self, request: Request) -> Response:
        """Route the request (see `pick`) and relay the replica's answer; a replica that cannot
        be reached hands it to the next live one."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        path, hashes, hello = request.url.path, [], self.feeds.hello
        if self.hasher is not None and hello is not None and hello.unit:
            hashes = await self.hasher.hashes(path, body, hello.model_id, hello.unit, hello.family)
        return await self.send(routing_key(body), request, path, raw, hashes=hashes, session=session_of(body))

    async def send(
        self, key: bytes, request: Request, path: str, raw: bytes = b"", count: bool = True, hashes=(), session=None
    ) -> Response:
        """Relay to the live replica `pick` chooses; one that cannot be reached hands the request
        to the next. `count`: the request counts in the replica's `routed`."""
        tried: set[int] = set()
        while True:
            replica = self.pick(key, tried, hashes, session)
            try:
                answer = await self.relay(replica, request, path, raw)
            except Unreached:
                tried.add(replica.index)
                continue
            except APIError:
                replica.routed += count
                raise
            replica.routed += count
            return answer

    async def relay(self, replica: Replica, request: Request, path: str, raw: bytes = b"") -> Response:
        """`request` (method, body, authorization) sent to `replica` at `path`, its answer streamed
        back; 502 naming the replica's death if it dies before answering."""
        proc, index = replica.proc, replica.index
        upstream = self.client.build_request(
            request.method, replica.url + path, content=raw, headers=passed_headers(request)
        )
        replica.inflight += 1
        try:
            resp = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            replica.inflight -= 1
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                raise Unreached(503, f"replica {index} did not answer", "service_unavailable") from None
            ended = await death(proc)
            if ended is None:
                raise APIError(502, f"replica {index} failed before answering", "server_error") from None
            raise APIError(502, self.died(index, ended), "server_error") from None

        def done():
            replica.inflight -= 1

        async def broken() -> str:
            ended = await death(proc)
            return f"replica {index} failed mid-answer" if ended is None else self.died(index, ended)

        return stream_back(resp, done, broken)

    @staticmethod
    def died(index: int, ended: str) -> str:
        return f"data-parallel replica {index} died ({ended}) while serving this request; it is being restarted"

    async def ready_count(self) -> int:
        """How many live replicas answer `/ready` with 200 (within 5 s)."""
        return sum(await ready_flags(self.client, [r.url for r in self.live()]))

    def _routing_metrics(self) -> list[str]:
        rs, batches, decisions = self.replicas, self.feeds.batches, self.router.decisions
        return [
            "# HELP deltaserve:dp_route_decisions_total Routing decisions by reason (resume_<tier>: where "
            "the longest prefix resumes; affinity: the session's replica; hash: the prompt start's "
            "rendezvous replica, nothing resumable; load: the less loaded).",
            "# TYPE deltaserve:dp_route_decisions_total counter",
            *(f'deltaserve:dp_route_decisions_total{{reason="{w}"}} {decisions[w]}' for w in REASONS),
            "# HELP deltaserve:dp_route_boundaries Resumable boundaries the front knows each replica holds.",
            "# TYPE deltaserve:dp_route_boundaries gauge",
            *(f'deltaserve:dp_route_boundaries{{replica="{r.index}"}} {self.router.index.count(r.index)}' for r in rs),
            "# HELP deltaserve:dp_route_event_batches_total Resumable-prefix event batches applied per replica.",
            "# TYPE deltaserve:dp_route_event_batches_total counter",
            *(f'deltaserve:dp_route_event_batches_total{{replica="{r.index}"}} {batches[r.index]}' for r in rs),
        ]

    def metrics(self) -> str:
        rs = self.replicas
        lines = [
            "# HELP deltaserve:dp_requests_total Requests the front routed to each replica.",
            "# TYPE deltaserve:dp_requests_total counter",
            *(f'deltaserve:dp_requests_total{{replica="{r.index}"}} {r.routed}' for r in rs),
            "# HELP deltaserve:dp_requests_inflight Requests in flight at each replica.",
            "# TYPE deltaserve:dp_requests_inflight gauge",
            *(f'deltaserve:dp_requests_inflight{{replica="{r.index}"}} {r.inflight}' for r in rs),
            *self._routing_metrics(),
            "# HELP deltaserve:dp_replicas Replicas configured (--data-parallel-size).",
            "# TYPE deltaserve:dp_replicas gauge",
            f"deltaserve:dp_replicas {len(rs)}",
            "# HELP deltaserve:dp_replicas_live Replicas answering and routed to.",
            "# TYPE deltaserve:dp_replicas_live gauge",
            f"deltaserve:dp_replicas_live {len(self.live())}",
            "# HELP deltaserve:dp_replica_restarts_total Replica processes started again after a failure.",
            "# TYPE deltaserve:dp_replica_restarts_total counter",
            *(f'deltaserve:dp_replica_restarts_total{{replica="{r.index}"}} {r.restarts}' for r in rs),
            "# HELP deltaserve:dp_replica_failures_total Replica failures: exits, starts past the deadline.",
            "# TYPE deltaserve:dp_replica_failures_total counter",
            *(
                f'deltaserve:dp_replica_failures_total{{replica="{r.index}",reason="{why}"}} {r.failures[why]}'
                for r in rs
                for why in FAILURE_REASONS
            ),
        ]
        return "\n".join(lines) + "\n"


def build_front_app(front: Front, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The front's app; `max_body_bytes` should be the replicas' largest cap (images grow it)."""

    @asynccontextmanager
    async def lifespan(app):
        front.feeds.start()  # the replicas' resumable-prefix feeds, polled while the front runs
        yield
        await front.feeds.stop()

    app = front_app("deltaserve (data parallel)", api_key, max_body_bytes, front.metrics, lifespan)
    for path in FORWARDED:
        app.add_api_route(path, front.forward, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        return await front.send(b"", request, "/v1/models", count=False)

    @app.get("/ready")
    async def ready():
        n = await front.ready_count()
        if not n:
            total = len(front.replicas)
            raise APIError(503, f"no data-parallel replica is ready (0 of {total})", "service_unavailable")
        return {"status": "ready", "replicas": len(front.replicas), "live": n}

    @app.get("/replicas/{index}/metrics")
    async def replica_metrics(index: int, request: Request):
        if not 0 <= index < len(front.replicas):
            raise APIError(404, f"no replica {index}", "not_found_error")
        if not front.replicas[index].live:
            raise APIError(503, f"replica {index} is not live", "service_unavailable")
        return await front.relay(front.replicas[index], request, "/metrics")

    return app


def replica_argv(args: argparse.Namespace, parser: argparse.ArgumentParser, model: str) -> list[str]:
    """`deltaserve serve` flags that reproduce `args` (as parsed by `parser`) for one replica,
    without the front's own (`FRONT_ONLY`)."""
    argv = [model]
    for action in parser._actions:
        if not action.option_strings or action.option_strings[0] in FRONT_ONLY or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(action.option_strings[0])
        elif isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            argv.append(action.option_strings[0 if value else 1])
        elif isinstance(value, list):
            argv += [action.option_strings[0], *map(str, value)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv
