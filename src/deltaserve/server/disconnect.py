"""Abandoned non-streaming requests: `until_disconnect(request, work)` runs `work` unless the
client goes away first, in which case `work` is cancelled (so a collector's `finally` aborts its
engine request, freeing its pages and KDA slot) and `ClientDisconnected` is raised.

A streamed response needs none of this: Starlette's `StreamingResponse` watches for the
disconnect itself and cancels its body, whose `finally` aborts the request.
Invariant: the ASGI receive channel is only read here once the body has been parsed, so nothing
else competes for its messages; after the body, its only message is `http.disconnect`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from fastapi import Request


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _disconnected(receive) -> None:
    """Returns when the client is gone (a receive channel that fails counts as gone)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:
        return


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """`await work`, racing it against the client's disconnect; however this ends early
    (disconnect, or this coroutine itself cancelled), `work` is cancelled and awaited."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientDisconnected
    return task.result()
