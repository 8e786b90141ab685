"""HTTP-level errors: `APIError` (an OpenAI-style error response), the validation-message
formatter and the body-size middleware (413 for a declared body over the limit)."""
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
    """ASGI middleware: 413 for a declared body over `limit` bytes."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope.get("headers", ())).get(b"content-length", b"0")
            if not length.isdigit() or int(length) > self.limit:
                msg = f"request body over {self.limit} bytes" if length.isdigit() else "bad Content-Length"
                status = 413 if length.isdigit() else 400
                await JSONResponse(error_body(msg), status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
