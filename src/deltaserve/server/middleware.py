"""ASGI middleware around the app: `ErrorGuard` (outermost: no error is ever plain text) and
`ApiKeyAuth` (the key is checked from the headers, before any of the body is read or parsed).

Order, outermost first: `ErrorGuard`, `ApiKeyAuth`, `BodyLimit` (errors.py), the routes; so an
unauthenticated request gets 401 whatever its body (malformed, oversized or half-sent).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from .errors import INTERNAL_ERROR
from .protocol import error_body

log = logging.getLogger(__name__)


class ErrorGuard:
    """An exception no handler answered is logged with its traceback and answered 500
    `server_error` with a fixed message (never the exception's text); a request cancelled by
    the server (its shutdown deadline passed) is answered 503 before the cancellation goes on.
    If the response had already started, nothing more can be sent: the connection is closed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            return  # nobody is left to answer
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await JSONResponse(error_body(INTERNAL_ERROR, "server_error"), 500)(scope, receive, send)
        except asyncio.CancelledError:
            if not started:
                body = error_body("the server is shutting down", "service_unavailable")
                await JSONResponse(body, 503)(scope, receive, send)
            raise


class ApiKeyAuth:
    """Every HTTP request but those to `open_paths` needs `Authorization: Bearer KEY` (compared
    in constant time); otherwise 401 `authentication_error`, sent without reading the body."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    def authorized(self, scope) -> bool:
        header = dict(scope.get("headers", ())).get(b"authorization", b"")
        given = header[7:].strip() if header[:7].lower() == b"bearer " else b""
        return hmac.compare_digest(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths and not self.authorized(scope):
            body = error_body("invalid or missing API key", "authentication_error", code="invalid_api_key")
            await JSONResponse(body, 401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def front_app(title: str, api_key: str | None, max_body_bytes: int, metrics, lifespan=None):
    """The FastAPI app of a front that relays to engine servers (`replica_front`, the
    disaggregation proxy): OpenAI-style errors, the same middleware as a server, `/health` and
    `/metrics` (the text `metrics()` returns); the caller adds its routes and `/ready`, and may
    give the app's `lifespan`."""
    from fastapi import FastAPI, Response

    from .errors import APIError, BodyLimit

    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics(), media_type="text/plain; version=0.0.4")

    async def _api_error(request, exc: APIError):
        return exc.response()

    app.add_exception_handler(APIError, _api_error)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, key=api_key)
    app.add_middleware(ErrorGuard)
    return app
