"""The OpenAI-compatible app: `build_app(engine, served_model_name, api_key=None,
max_body_bytes=MAX_BODY_BYTES, max_waiting_requests=None, retry_after_s=1, media=None,
image_processor=None)`.

It creates the FastAPI app (the engine thread starts with it), installs the middleware
(outermost first: `ErrorGuard`, `ApiKeyAuth` when a key is set, `BodyLimit`), the error handlers
and the routers of `routes/`, and stores the shared `ServerState` (engine, model name, a fresh
`Metrics`, queue cap) on `app.state.server`. Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` (the data-parallel front's resumable-prefix
feed, `cache_feed.py`, answers msgpack); messages never carry internals (an
unexpected exception is logged and answered 500 `server_error`, see `middleware.py`, which also
checks the API key before the body is read). With `max_waiting_requests` set, a generation
request arriving while that many are queued gets 429 with `Retry-After`, before any work. With an
`image_processor` (a K3 engine with a vision tower) chat requests may carry images under `media`'s
limits (`media.py`; PIL's process-wide bomb guard is set to its pixel cap); without one, image
parts are refused.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..model.image_processor import ImageProcessor
from . import cache_feed
from .async_engine import AsyncEngine
from .errors import APIError, BodyLimit, validation_message
from .media import MediaPolicy
from .metrics import Metrics
from .middleware import ApiKeyAuth, ErrorGuard
from .protocol import MAX_BODY_BYTES, error_body
from .routes import chat, completions, misc
from .sampling_policy import POLICIES
from .state import ServerState


async def _api_error(request, exc: APIError):
    return exc.response()


async def _invalid(request, exc: RequestValidationError):
    msg, param = validation_message(exc)
    return JSONResponse(error_body(msg, param=param), 400)


async def _http(request, exc: StarletteHTTPException):
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), type_), exc.status_code)


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_waiting_requests: int | None = None,
    retry_after_s: int = 1,
    media: MediaPolicy | None = None,
    image_processor: ImageProcessor | None = None,
    sampling_policy: str = "open",
    channel_guard: bool = True,
) -> FastAPI:
    """The FastAPI app over a started-or-not `AsyncEngine` (started on app start-up);
    `max_waiting_requests=None` means no queue cap; `sampling_policy` in `POLICIES`
    (sampling_policy.py); `channel_guard` (K3, on by default) guards each reply's structure (channel_guard.py)."""
    if sampling_policy not in POLICIES:
        raise ValueError(f"unknown sampling policy {sampling_policy!r}; expected one of {POLICIES}")
    media = media or MediaPolicy()
    if image_processor is not None:
        if engine.family != "kimi_k3":
            raise ValueError(f"images are served for kimi_k3 only, not {engine.family}")
        media.install_pil_guard()

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield

    app = FastAPI(title="deltaserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, key=api_key)
    app.add_middleware(ErrorGuard)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.state.server = ServerState(
        engine,
        served_model_name,
        Metrics(served_model_name),
        max_waiting_requests,
        retry_after_s,
        media,
        image_processor,
        sampling_policy=sampling_policy,
        channel_guard=channel_guard and engine.family == "kimi_k3",
    )
    for module in (completions, chat, misc, cache_feed):
        app.include_router(module.router)
    return app
