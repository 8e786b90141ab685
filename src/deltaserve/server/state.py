"""`ServerState`: what the routes share (the engine, the served model's name, its metrics and the
queue cap), stored on `app.state.server` by `app.build_app` and handed to a route through the
`State` dependency. Its methods are the steps every generation route takes: admission (429 over
the queue cap, before any work), the model check, sampling params, submission, and the
CPU-bound prompt work (chat rendering, encoding, decoding, images) run on a worker thread so the
event loop keeps serving other requests meanwhile. Image parts are accepted only with an
`image_processor` (a K3 checkpoint with a vision tower, `media.vision_processor`); then each
renders as one `<|media_pad|>`, then `chat_images` turns the parts into the engine's `ImageInput`s
under `media`'s limits (`media.py`) and expands each pad into its image's block; without one they
are refused (400).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from ..chat.common import ChatFormatError
from ..chat.render import render_chat
from ..engine.request.multimodal import ImageInput
from ..engine.request.sampling_params import SamplingParams, SamplingParamsError
from ..engine.request.sequence import InvalidRequestError
from ..model.image_processor import ImageProcessor
from ..model.tokenizer import TokenizerError
from .async_engine import AsyncEngine
from .errors import APIError
from .media import MediaError, MediaPolicy, check_count, request_images
from .metrics import Metrics
from .request_stream import EngineDeadError, RequestStream


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    model_name: str
    metrics: Metrics
    max_waiting_requests: int | None = None  # None: no queue cap
    retry_after_s: int = 1
    media: MediaPolicy = MediaPolicy()
    image_processor: ImageProcessor | None = None  # None: image parts are refused
    handoff: Any = None  # a decode instance's `disagg.decode.DecodeHandoff`: `.submit(state, ids, params, images)`
    sampling_policy: str = "open"  # "open" | "k3" (server/sampling_policy.py)
    channel_guard: bool = True  # K3 (default on): guard the assistant structure by grammar (server/channel_guard.py)

    def admit(self) -> None:
        """429 with `Retry-After` while `max_waiting_requests` requests are queued."""
        if self.max_waiting_requests is not None and self.engine.queue_load() >= self.max_waiting_requests:
            self.metrics.rejected.inc()
            raise APIError(
                429,
                "the server is overloaded: too many waiting requests; retry later",
                "rate_limit_error",
                code="too_many_waiting_requests",
                headers={"Retry-After": str(self.retry_after_s)},
            )

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist", "not_found_error", "model", "model_not_found")

    def require_tokenizer(self):
        if self.engine.tokenizer is None:
            raise APIError(400, "this model was loaded without a tokenizer")
        return self.engine.tokenizer

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "deltaserve",
            "max_model_len": self.engine.max_model_len,
        }

    @staticmethod
    def make_params(kw: dict, **extra) -> SamplingParams:
        try:
            return SamplingParams(**kw, **extra)
        except SamplingParamsError as e:
            raise APIError(400, str(e)) from None

    async def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        images: list[ImageInput] | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; on a decode instance its prompt may first arrive by handoff (not a
        salted one: it runs here). `cache_salt` enters the first prefix hash (vLLM's): requests
        with different salts share no cached prefix."""
        if self.handoff is not None and cache_salt is None:
            return await self.handoff.submit(self, ids, params, images)
        return await self.submit_local(ids, params, images, **({"cache_salt": cache_salt} if cache_salt else {}))

    async def submit_local(
        self, ids: list[int], params: SamplingParams, images: list[ImageInput] | None = None, **options
    ) -> RequestStream:
        try:
            stream = await self.engine.add(ids, params, images=images, **options)
        except (InvalidRequestError, SamplingParamsError) as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError:
            raise APIError(503, "the engine is not running", "service_unavailable") from None
        stream.observer = self.metrics.track(len(ids), params.n)
        return stream

    async def chat_prompt(self, messages, tools, thinking: bool, controls=()) -> list[int]:
        """The rendered chat prompt's ids (on a worker thread; one pad or placeholder per image part);
        a `ChatFormatError`, or more image parts than `media.max_images`, is a 400."""
        tok, engine = self.require_tokenizer(), self.engine
        accept = self.image_processor is not None
        try:
            if accept:
                check_count(messages, self.media)
            ids = await asyncio.to_thread(
                render_chat,
                tok,
                engine.family,
                messages,
                tools=tools,
                thinking=thinking,
                chat_template=engine.chat_template,
                controls=controls,
                accept_images=accept,
            )
        except (ChatFormatError, MediaError) as e:
            raise APIError(400, str(e), param=getattr(e, "param", None) or "messages") from None
        return ids

    async def chat_images(self, messages, ids: list[int]) -> tuple[list[int], list[ImageInput]]:
        """`(ids, images)`: the messages' images in prompt order, decoded and preprocessed
        (`media.request_images`), and `ids` with each image's pad expanded into its block
        (`ImagePrompts.expand_rendered`); a refused image is a 400. No images when they are not accepted
        (the render refused them)."""
        if self.image_processor is None:
            return ids, []
        try:
            images = await request_images(messages, self.media, self.image_processor)
        except MediaError as e:
            raise APIError(400, str(e), param="messages") from None
        if not images:
            return ids, []
        return await asyncio.to_thread(self.engine.core.image_prompts.expand_rendered, ids, images), images

    async def encode(self, text: str) -> list[int]:
        """`text`'s ids, specials disallowed (on a worker thread)."""
        return await asyncio.to_thread(self.require_tokenizer().encode, text)

    async def decode(self, ids: list[int]) -> str:
        """The text of `ids` (on a worker thread); a `TokenizerError` is a 400."""
        tok = self.require_tokenizer()
        try:
            return await asyncio.to_thread(tok.decode, ids)
        except TokenizerError as e:
            raise APIError(400, str(e), param="tokens") from None


def get_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(get_state)]
