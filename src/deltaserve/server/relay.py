"""Relaying to engine servers, shared by the data-parallel front (`replica_front.py`) and the
disaggregation proxy: which client headers travel, an upstream answer streamed back as it comes
(an SSE stream that breaks mid-answer ends with an error event and `[DONE]`), and readiness of a
set of servers."""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse

from .protocol import error_body

PASSED = ("authorization", "content-type")  # client headers sent on
KEPT = ("content-type", "retry-after")  # upstream headers sent back


def passed_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in PASSED}


def stream_back(
    resp: httpx.Response,
    done: Callable[[], None],
    broken: str | Callable[[], Awaitable[str]],
    on_break=None,
) -> StreamingResponse:
    """`resp` (sent with `stream=True`) relayed chunk by chunk; `done()` runs once it is over. If
    the upstream breaks mid-answer, `on_break()` runs and an SSE answer ends with `broken` (or
    what `await broken()` says then) as an error event."""
    sse = resp.headers.get("content-type", "").startswith("text/event-stream")

    async def chunks():
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            if on_break is not None:
                on_break()
            if sse:
                message = broken if isinstance(broken, str) else await broken()
                yield f"data: {json.dumps(error_body(message, 'server_error'))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()
            done()

    kept = {k: v for k, v in resp.headers.items() if k.lower() in KEPT}
    return StreamingResponse(chunks(), status_code=resp.status_code, headers=kept)


async def ready_flags(client: httpx.AsyncClient, urls: list[str]) -> list[bool]:
    """For each server, whether it answers `/ready` with 200 (within 5 s)."""

    async def one(url: str) -> bool:
        try:
            return (await client.get(url + "/ready", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    return list(await asyncio.gather(*(one(u) for u in urls)))


async def all_ready(client: httpx.AsyncClient, urls: list[str]) -> bool:
    """Whether every server answers `/ready` with 200 (within 5 s)."""
    return all(await ready_flags(client, urls))
