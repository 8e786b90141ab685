"""HTTP-level errors: `APIError` (an OpenAI-style error response), the validation-message
formatter and the body-size middleware (413 for a body over the limit, declared or chunked)."""
from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .protocol import error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    return (f"{param}: {e.get('msg', 'invalid value')}" if param else e.get("msg", "invalid request")), param


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
                await JSONResponse(error_body(f"request body over {self.limit} bytes"), 413)(
                    scope, receive, send)
                return
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()
        await self.app(scope, replayed, send)
