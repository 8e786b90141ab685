"""`deltaserve proxy --prefill URL... --decode URL...`: the OpenAI-compatible front of a
disaggregated deployment.

For each chat or completion request the proxy asks every decode instance what of the prompt
it holds (`/disagg/match`: the joint hit, MLA pages plus a KDA checkpoint, and the MLA-only
coverage) and picks the one holding the most: joint hit first (only it saves computation),
then MLA coverage (it saves transfer bytes), then the lower load, then a rendezvous hash of the
request's prefix. A session's next turn thus returns to the instance that cached it. The
prefill instances are asked the same at once, and also how far a restore from their host or disk
tier would resume: the request's prefill goes to the best `choose_prefill` score (the longest
resumable prefix, MLA pages and a KDA checkpoint, weighed by tier as the data-parallel router
does, minus load; none answering, the least loaded), named to the decode instance in a header; the
decode instance pulls the prompt's cache from it and streams the answer, relayed here as it
comes. The proxy never tokenizes: the decode instance renders the prompt once.
A decode instance that fails is an error to the client (503 before the answer starts, an SSE
error event after); the prefill side frees what it computed for it at its park timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from . import env
from .cache.events import DEVICE, DISK, HOST, TIERS
from .disagg.protocol import MSGPACK, PREFILL_HEADER, SECRET_HEADER, MatchReply, MatchRequest, decode, encode
from .engine.dp.routing import best_resume, rendezvous, resume_score
from .replica_front import routing_key
from .server.errors import APIError
from .server.middleware import front_app
from .server.protocol import MAX_BODY_BYTES
from .server.relay import all_ready, passed_headers, stream_back

log = logging.getLogger("deltaserve.proxy")
GENERATION = ("/v1/chat/completions", "/v1/completions")


def resumable(m: MatchReply | None) -> dict[int, int]:
    """Tier code (`cache.events.TIERS`) -> tokens of the prompt resumable there, per `m`."""
    return {} if m is None else {DEVICE: m.joint_tokens, HOST: m.host_tokens, DISK: m.disk_tokens}


def choose_prefill(replies: list[MatchReply | None], loads: list[int]) -> tuple[int, str, int]:
    """(index, reason, tokens resumed) of the prefill instance to use: the highest
    `routing.resume_score` (the data-parallel router's tier weights, minus load) of its best
    tier's resumable prefix (None: it did not answer, nothing resumes there); equal scores go to
    the lower load, then the lower index. Reason: `resume_<tier>` where some prefix resumes
    there, else "load"."""

    def score(i: int) -> tuple[float, int, int]:
        k, tier = best_resume(resumable(replies[i]))
        n = replies[i].num_tokens if replies[i] is not None else 0
        return resume_score(k, tier, n, loads[i]), -loads[i], -i

    best = max(range(len(loads)), key=score)
    k, tier = best_resume(resumable(replies[best]))
    return best, f"resume_{TIERS[tier]}" if k else "load", k


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], secret: str, match_timeout_s: float = 10.0):
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        bad = [u for u in (*prefill, *decode) if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"an instance is an http:// or https:// URL, got {', '.join(map(repr, bad))}")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self.secret = secret
        self.inflight = Counter()
        self.counters: Counter[str] = Counter()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self.match_timeout_s = match_timeout_s

    async def _match(self, url: str, path: str, body: dict) -> MatchReply | None:
        try:
            r = await self.client.post(
                url + "/disagg/match",
                content=encode(MatchRequest(path, body)),
                headers={SECRET_HEADER: self.secret, "content-type": MSGPACK},
                timeout=self.match_timeout_s,
            )
            return decode(r.content, MatchReply) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def rank_decode(self, path: str, body: dict) -> list[tuple[str, MatchReply]]:
        """The decode instances that answered, best first (see the module docstring)."""
        replies = await asyncio.gather(*(self._match(u, path, body) for u in self.decode))
        live = [(u, m) for u, m in zip(self.decode, replies) if m is not None]
        if not live:
            raise APIError(503, "no decode instance answered", "service_unavailable")
        home = self.decode[rendezvous(routing_key(body), len(self.decode))]
        return sorted(live, key=lambda um: (um[1].joint_tokens, um[1].mla_tokens, -um[1].load, um[0] == home))[::-1]

    def _count_route(self, m: MatchReply) -> None:
        kind = "joint_hit" if m.joint_tokens else "mla_only" if m.mla_tokens else "cold"
        self.counters[f"routed_{kind}"] += 1
        self.counters["joint_hit_tokens"] += m.joint_tokens
        self.counters["mla_hit_tokens"] += m.mla_tokens

    async def pick_prefill(self, path: str, body: dict) -> str:
        """The prefill instance `choose_prefill` picks (loads: the requests this proxy has in
        flight there), counted by reason (`prefill_routed_<reason>`)."""
        replies = await asyncio.gather(*(self._match(u, path, body) for u in self.prefill))
        i, reason, resumed = choose_prefill(replies, [self.inflight[u] for u in self.prefill])
        self.counters[f"prefill_routed_{reason}"] += 1
        self.counters["prefill_joint_hit_tokens"] += resumed
        return self.prefill[i]

    async def forward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        path = request.url.path
        ranked, prefill_url = await asyncio.gather(self.rank_decode(path, body), self.pick_prefill(path, body))
        headers = passed_headers(request) | {SECRET_HEADER: self.secret, PREFILL_HEADER: prefill_url}
        self.inflight[prefill_url] += 1
        resp = None
        for decode_url, m in ranked:  # the next best if one does not take the request
            upstream = self.client.build_request("POST", decode_url + path, content=raw, headers=headers)
            try:
                resp = await self.client.send(upstream, stream=True)
                break
            except httpx.HTTPError:
                self.counters["decode_failures"] += 1
        if resp is None:
            self.inflight[prefill_url] -= 1
            raise APIError(503, "no decode instance took the request", "service_unavailable")
        self._count_route(m)
        self.inflight[decode_url] += 1

        def done():
            self.inflight[prefill_url] -= 1
            self.inflight[decode_url] -= 1

        def broke():
            self.counters["decode_failures"] += 1

        self.counters["requests"] += 1
        return stream_back(resp, done, f"the decode instance {decode_url} failed mid-answer", broke)

    async def ready(self) -> bool:
        return await all_ready(self.client, self.prefill + self.decode)

    def metrics(self) -> str:
        lines = []
        for key, value in sorted(self.counters.items()):
            lines += [f"# TYPE deltaserve:proxy_{key} counter", f"deltaserve:proxy_{key} {value}"]
        return "\n".join(lines) + "\n"


def build_proxy_app(proxy: Proxy, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = front_app("deltaserve (prefill/decode proxy)", api_key, max_body_bytes, proxy.metrics)
    for path in GENERATION:
        app.add_api_route(path, proxy.forward, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for url in proxy.decode:  # the first decode instance that answers
            try:
                r = await proxy.client.get(url + "/v1/models", headers=headers, timeout=10.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        raise APIError(503, "no decode instance answered", "service_unavailable")

    @app.get("/ready")
    async def ready():
        if not await proxy.ready():
            raise APIError(503, "an instance is not ready", "service_unavailable")
        return {"status": "ready", "prefill": len(proxy.prefill), "decode": len(proxy.decode)}

    return app


def add_proxy_arguments(p) -> None:

    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=env.API_KEY.get(), help="required of clients")
    p.add_argument("--disagg-secret", default=None, help="the instances' shared secret (see serve --help)")


def run_proxy(args) -> int:
    import uvicorn

    from .disagg.protocol import load_secret
    from .roles import start_failure
    from .serve import exit_cleanly_on_sigterm

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        proxy = Proxy(args.prefill, args.decode, load_secret(args.disagg_secret))
    except Exception as e:
        log.error("%s", start_failure("the proxy", e))
        return 1
    log.info("proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, proxy.prefill, proxy.decode)
    exit_cleanly_on_sigterm()
    uvicorn.run(build_proxy_app(proxy, args.api_key), host=args.host, port=args.port, log_level="info")
    return 0
