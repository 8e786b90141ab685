"""What the generation routes share: SSE framing (`sse`, `sse_stream`: chunks, the usage
chunk, an error event for a failure, then `[DONE]`), the collection of a non-streaming response
(`run_collect`: aborted when the client disconnects), `usage`, `sampling_kwargs` and
`check_request` (the request-time 400s that need the prompt's length or the vocabulary).
Non-streaming responses are assembled from the same delta stream as streaming ones, so the two
agree for the same seed.
"""

from __future__ import annotations

import json

from fastapi import Request

from ..disconnect import ClientDisconnected, until_disconnect
from ..errors import APIError, public_message
from ..protocol import error_body


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sampling_kwargs(req) -> dict:
    """The request's sampling fields; an invalid `stop` is a 400."""
    try:
        return req.sampling_kwargs()
    except ValueError as e:
        raise APIError(400, str(e), param="stop") from None


def check_request(state, req, prompt_lens: list[int], max_tokens: int | None, max_tokens_param: str) -> None:
    """400s the engine would not give with the field named: `max_tokens` beyond what
    max_model_len leaves after a prompt (as vLLM; a prompt longer than max_model_len is the
    engine's own refusal), `logit_bias` ids outside the model's vocabulary."""
    limit = state.engine.max_model_len
    n = max((p for p in prompt_lens if p <= limit), default=None)
    if max_tokens is not None and n is not None and n + max_tokens > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens, but {n + max_tokens} were requested "
            f"({n} in the prompt, {max_tokens} in the completion); lower {max_tokens_param} or shorten the prompt",
            param=max_tokens_param,
        )
    vocab = state.engine.core.model.config.vocab_size
    bad = sorted(t for t in req.logit_bias or () if t >= vocab)
    if bad:
        raise APIError(400, f"logit_bias token ids outside the vocabulary [0, {vocab}): {bad[:8]}", param="logit_bias")


async def sse_stream(body, stream, head: dict, prompt_len: int, counts: list[int], include_usage: bool):
    """SSE framing shared by both endpoints: the body's chunks, then the usage chunk, an
    error event if anything failed (`public_message`), `[DONE]`; chunks are encoded here, so
    an encoding failure is such a failure too; the request is aborted however it ends."""
    try:
        async for item in body:
            yield item.encode()
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_len, sum(counts))}).encode()
    except Exception as e:
        yield sse(error_body(public_message(e), "server_error")).encode()
    finally:
        stream.abort()
    yield b"data: [DONE]\n\n"


async def drain(stream, on_delta) -> None:
    """Feed every delta to `on_delta`; abort the request if we stop early."""
    try:
        async for d in stream:
            on_delta(d)
    finally:
        stream.abort()


async def run_collect(stream, on, request: Request) -> None:
    """`drain`, aborted if the client disconnects first (answered 499, which nobody reads)."""
    try:
        await until_disconnect(request, drain(stream, on))
    except ClientDisconnected:
        raise APIError(499, "the client closed the connection", code="client_closed_request") from None
    except Exception as e:
        raise APIError(500, public_message(e), "server_error") from None
