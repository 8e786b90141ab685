"""HTTP-level errors: `APIError` (an OpenAI-style error response), the validation-message
formatter, `public_message` (what a client may see of a failure) and the body-size middleware
(413 for a body over the limit, declared or chunked)."""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .protocol import error_body
from .request_stream import EngineDeadError, GenerationError

log = logging.getLogger(__name__)

INTERNAL_ERROR = "internal server error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code), self.status, headers=self.headers
        )


def _field_path(loc) -> list[str]:
    """A validation error's location as the request's own field path: without "body" and the
    validator's names for the shapes a union field tried (`literal['none','auto']`, a model
    class such as `NamedToolChoice`; API fields are snake_case)."""
    return [str(x) for x in loc if x != "body" and not (isinstance(x, str) and ("[" in x or x[:1].isupper()))]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the first invalid field; for a union field, the shape that got
    furthest (the deepest location: `{"type": "function"}` is a named tool choice missing
    `function`, not a bad literal)."""
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    top = _field_path(errs[0].get("loc", ()))[:1]
    e = max((x for x in errs if _field_path(x.get("loc", ()))[:1] == top), key=lambda x: len(x.get("loc", ())))
    loc = _field_path(e.get("loc", ()))
    param = ".".join(loc) or None
    msg = e.get("msg") or "invalid value"
    msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def public_message(exc: Exception) -> str:
    """The message a client may see for a failed generation: the text of the engine side's own
    failures (`GenerationError`, `EngineDeadError`, the engine thread's plain `RuntimeError`s,
    all written for clients); anything else is a bug, logged here with its traceback and
    reported as "internal server error"."""
    if isinstance(exc, (GenerationError, EngineDeadError)) or type(exc) is RuntimeError:
        return str(exc)
    log.error("request failed", exc_info=exc)
    return INTERNAL_ERROR


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, whether declared (Content-Length,
    checked before reading) or sent without a length (chunked: the body is read here, counted
    as it arrives, and refused as soon as it passes the limit, never buffered beyond it). A body
    that fits is replayed to the app; later `receive` calls (disconnects) pass through."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.limit:
                msg = f"request body over {self.limit} bytes" if length.isdigit() else "bad Content-Length"
                await JSONResponse(error_body(msg), 413 if length.isdigit() else 400)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away before the body was complete
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.limit:
                await JSONResponse(error_body(f"request body over {self.limit} bytes"), 413)(scope, receive, send)
                return
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)
