"""`deltaserve serve --data-parallel-size N`: N engine replicas behind one OpenAI-compatible front.

Each replica is a whole `deltaserve serve` (its own scheduler, caches and tensor-parallel ranks)
started as a subprocess on a loopback port with the same flags; the front forwards every API
request (streams relayed as they come, the client's `Authorization` passed on) to one replica:
- **prefix-affine**: the routing key is the start of the prompt (a chat's messages before the
  last), hashed against each replica (rendezvous hashing), so the turns of one conversation and
  requests sharing a system prompt land where their prefix is cached;
- **load-bounded**: a replica with `SPILL` more requests in flight than the least loaded one
  gives way to it.

`/health` is the front's; `/ready` is 200 only while every replica is ready; `/metrics` counts
requests per replica, and each replica's own metrics are at `/replicas/{i}/metrics`. A replica
that exits turns `/ready` 503 and the front exits 1 (as a tensor-parallel server does when a rank
dies); stopping the front stops the replicas.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from .engine.dp.routing import SPILL, rendezvous
from .env import EXIT_WITH_PARENT
from .server.errors import APIError
from .server.middleware import front_app
from .server.protocol import MAX_BODY_BYTES
from .server.relay import all_ready, passed_headers, stream_back

log = logging.getLogger("deltaserve.replicas")

KEY_BYTES = 2048  # prompt bytes the routing key hashes
FORWARDED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
FRONT_ONLY = ("--data-parallel-size", "--port", "--host")


@dataclass
class Replica:
    index: int
    url: str
    proc: subprocess.Popen
    inflight: int = 0
    routed: int = 0


def routing_key(body: dict) -> bytes:
    """The start of the shared part of a request's prompt (see the module docstring)."""
    if isinstance(body.get("messages"), list):
        messages = body["messages"]
        prompt = messages[:-1] if len(messages) > 1 else messages
    else:
        prompt = body.get("prompt", "")
    salt = body.get("cache_salt") or ""
    return (json.dumps(salt) + json.dumps(prompt, sort_keys=True, default=str)).encode()[:KEY_BYTES]


class Front:
    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas
        self.failure: str | None = None
        self.closing = False
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    def pick(self, key: bytes) -> Replica:
        """The prefix-affine replica unless it is `SPILL` requests busier than the least loaded."""
        home = self.replicas[rendezvous(key, len(self.replicas))]
        least = min(self.replicas, key=lambda r: r.inflight)
        return home if home.inflight <= least.inflight + SPILL else least

    async def forward(self, request: Request) -> Response:
        """Route the request (see `pick`) and relay the replica's answer."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        replica = self.pick(routing_key(body if isinstance(body, dict) else {}))
        replica.routed += 1
        return await self.relay(replica, request, request.url.path, raw)

    async def relay(self, replica: Replica, request: Request, path: str, raw: bytes = b"") -> Response:
        """`request` (method, body, authorization) sent to `replica` at `path`, its answer streamed back."""
        upstream = self.client.build_request(
            request.method, replica.url + path, content=raw, headers=passed_headers(request)
        )
        replica.inflight += 1
        try:
            resp = await self.client.send(upstream, stream=True)
        except httpx.HTTPError:
            replica.inflight -= 1
            raise APIError(503, f"replica {replica.index} did not answer", "service_unavailable") from None

        def done():
            replica.inflight -= 1

        return stream_back(resp, done, f"replica {replica.index} failed mid-answer")

    async def ready(self) -> bool:
        return self.failure is None and await all_ready(self.client, [r.url for r in self.replicas])

    def metrics(self) -> str:
        lines = [
            "# HELP deltaserve:dp_requests_total Requests the front routed to each replica.",
            "# TYPE deltaserve:dp_requests_total counter",
            *(f'deltaserve:dp_requests_total{{replica="{r.index}"}} {r.routed}' for r in self.replicas),
            "# HELP deltaserve:dp_requests_inflight Requests in flight at each replica.",
            "# TYPE deltaserve:dp_requests_inflight gauge",
            *(f'deltaserve:dp_requests_inflight{{replica="{r.index}"}} {r.inflight}' for r in self.replicas),
        ]
        return "\n".join(lines) + "\n"


def build_front_app(front: Front, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The front's app; `max_body_bytes` should be the replicas' largest cap (images grow it)."""
    app = front_app("deltaserve (data parallel)", api_key, max_body_bytes, front.metrics)
    for path in FORWARDED:
        app.add_api_route(path, front.forward, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        return await front.relay(front.replicas[0], request, "/v1/models")

    @app.get("/ready")
    async def ready():
        if not await front.ready():
            raise APIError(503, front.failure or "a replica is not ready", "service_unavailable")
        return {"status": "ready", "replicas": len(front.replicas)}

    @app.get("/replicas/{index}/metrics")
    async def replica_metrics(index: int, request: Request):
        if not 0 <= index < len(front.replicas):
            raise APIError(404, f"no replica {index}", "not_found_error")
        return await front.relay(front.replicas[index], request, "/metrics")

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        elif isinstance(value, list):
            argv += [action.option_strings[0], *map(str, value)]
        else:
            argv += [action.option_strings[0], str(value)]
    return argv


EXIT_WITH_PARENT_ENV = EXIT_WITH_PARENT.name


def start_replicas(n: int, argv: list[str]) -> list[Replica]:
    """Start `n` replica servers on free loopback ports and wait until each answers /health."""
    replicas = []
    for i in range(n):
        port = _free_port()
        cmd = [sys.executable, "-m", "deltaserve.cli", "serve", *argv, "--host", "127.0.0.1", "--port", str(port)]
        env = dict(os.environ, **{EXIT_WITH_PARENT_ENV: "1"})  # a killed front takes its replicas along
        replicas.append(Replica(i, f"http://127.0.0.1:{port}", subprocess.Popen(cmd, env=env)))
    for r in replicas:
        while True:
            if r.proc.poll() is not None:
                stop_replicas(replicas)
                raise RuntimeError(f"replica {r.index} exited with code {r.proc.returncode} while starting")
            try:
                if httpx.get(r.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    return replicas


def stop_replicas(replicas: list[Replica], timeout: float = 15.0) -> None:
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.terminate()
    deadline = time.monotonic() + timeout
    for r in replicas:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()


def watch(front: Front, on_failure) -> None:
    """Poll the replicas; the first that exits fails the front (`on_failure(reason)`)."""

    def run():
        while front.failure is None and not front.closing:
            for r in front.replicas:
                if r.proc.poll() is not None and not front.closing:
                    front.failure = f"replica {r.index} (pid {r.proc.pid}) exited with code {r.proc.returncode}"
                    log.error("data-parallel front failed: %s", front.failure)
                    on_failure(front.failure)
                    return
            time.sleep(0.2)

    threading.Thread(target=run, name="deltaserve-replicas", daemon=True).start()
