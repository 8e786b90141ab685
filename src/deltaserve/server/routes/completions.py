"""`POST /v1/completions`: one prompt or a batch, `n` samples each, `echo`, streaming or not.

Invariants:
- A batch (a list of strings, or a list of token-id lists) becomes one engine request per
  prompt, submitted in order; choice `index` is `prompt_index * n + sample_index` (OpenAI's and
  vLLM's numbering). If any prompt is refused, the ones already queued are aborted and the
  whole request gets the refusal (400), so a batch is all-or-nothing.
- Text prompts are encoded (specials disallowed) on a worker thread, with the echoed text of
  token-id prompts.
- `echo` prefixes each choice's text with its prompt (a token-id prompt is decoded); streamed,
  the prompt is the choice's first chunk. `echo` with `logprobs` (prompt logprobs) and
  `suffix` are refused with 400, as vLLM refuses `suffix`.
- Usage sums the prompt tokens of every prompt (each counted once, whatever `n`).
- `response_format` (json_object / json_schema) is enforced as in chat, from the first token.
- Under `--sampling-policy k3` the sampling fields follow `sampling_policy.apply_policy` (K3's
  fixed values; the temperature picks the mode, as a raw prompt has no thinking switch).
- A client that disconnects before a non-streaming response is ready aborts every prompt's
  engine request (`run_collect`), as a dropped stream does.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ...engine.request.structured import StructuredOutput, StructuredOutputError
from ..errors import APIError
from ..protocol import MAX_BATCH, CompletionRequest
from ..sampling_policy import apply_policy
from ..state import ServerState, State
from .common import check_request, run_collect, sampling_kwargs, sse, sse_stream, usage

router = APIRouter()


class StreamGroup:
    """Several `RequestStream`s consumed as one: `(prompt_index, delta)` pairs in arrival order
    (each stream's own order kept); `abort()` aborts every unfinished one."""

    def __init__(self, streams: list):
        self.streams = streams

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    async def __aiter__(self):
        if len(self.streams) == 1:
            async for d in self.streams[0]:
                yield 0, d
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(k, s):
            try:
                async for d in s:
                    q.put_nowait((k, d, None))
                q.put_nowait((k, None, None))
            except Exception as e:
                q.put_nowait((k, None, e))

        tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(self.streams)]
        try:
            left = len(tasks)
            while left:
                k, d, err = await q.get()
                if err is not None:
                    raise err
                if d is None:
                    left -= 1
                    continue
                yield k, d
        finally:
            for t in tasks:
                t.cancel()
            self.abort()


def _prompt_batch(prompt) -> list:
    """The request's prompts: each a str or a list of token ids."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > MAX_BATCH:
            raise APIError(400, f"at most {MAX_BATCH} prompts are allowed in one request", param="prompt")
        return list(prompt)
    return [prompt]


def _structured(rf) -> StructuredOutput | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_schema" and rf.json_schema is None:
        raise APIError(
            400, 'response_format "json_schema" needs a json_schema object', param="response_format.json_schema"
        )
    try:
        return StructuredOutput.json(rf.json_schema.schema_ if rf.type == "json_schema" else None)
    except StructuredOutputError as e:
        raise APIError(400, str(e), param="response_format") from None


def _encode_batch(state: ServerState, prompts: list, echo: bool) -> tuple[list[list[int]], list[str]]:
    """Each prompt's ids and echoed text ("" without `echo`); CPU-bound, run on a worker thread."""
    batch = [state.require_tokenizer().encode(p) if isinstance(p, str) else list(p) for p in prompts]
    echoes = [
        (p if isinstance(p, str) else state.require_tokenizer().decode(ids)) if echo else ""
        for p, ids in zip(prompts, batch)
    ]
    return batch, echoes


def completion_logprobs(tok, d, offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entry in zip(d.token_ids, d.logprobs or []):
        piece = tok.decode([t], skip_special_tokens=True)
        out["tokens"].append(piece)
        out["token_logprobs"].append(entry[t].logprob)
        out["top_logprobs"].append({tok.decode([a], skip_special_tokens=True): lp.logprob for a, lp in entry.items()})
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


async def _submit_all(state: ServerState, batch: list[list[int]], params, cache_salt: str | None) -> StreamGroup:
    group = StreamGroup([])
    try:
        for ids in batch:
            group.streams.append(await state.submit(ids, params, cache_salt=cache_salt))
    except BaseException:
        group.abort()
        raise
    return group


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: State):
    state.admit()
    state.check_model(req.model)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")
    kw = apply_policy(state.sampling_policy, req, sampling_kwargs(req), None)
    prompts = _prompt_batch(req.prompt)
    if len(prompts) * req.n > MAX_BATCH:
        raise APIError(400, f"len(prompt) * n must be at most {MAX_BATCH}", param="n")
    batch, echoes = await asyncio.to_thread(_encode_batch, state, prompts, req.echo)
    params = state.make_params(
        kw, max_tokens=req.max_tokens, logprobs=req.logprobs, structured=_structured(req.response_format)
    )
    check_request(state, req, [len(ids) for ids in batch], req.max_tokens, "max_tokens")
    group = await _submit_all(state, batch, params, req.cache_salt)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
    }
    n_prompt = sum(len(ids) for ids in batch)
    if req.stream:
        return StreamingResponse(_events(req, state, group, echoes, head, n_prompt), media_type="text/event-stream")
    return await _collect(req, state, group, echoes, head, n_prompt, request)


def _events(
    req: CompletionRequest, state: ServerState, group: StreamGroup, echoes: list[str], head: dict, n_prompt: int
):
    """The SSE stream: each choice's echo first, then its deltas."""
    n, total, want_lp = req.n, len(echoes) * req.n, req.logprobs is not None
    counts, offsets, started = [0] * total, [0] * total, [False] * total

    def choice(i, text, lp=None, finish=None):
        return sse({**head, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]})

    async def events():
        async for k, d in group:
            i = k * n + d.index
            if echoes[k] and not started[i]:
                yield choice(i, echoes[k])
            started[i] = True
            counts[i] += len(d.token_ids)
            lp = completion_logprobs(state.engine.tokenizer, d, offsets[i]) if want_lp else None
            offsets[i] += len(d.text)
            yield choice(i, d.text, lp, d.finish_reason)

    return sse_stream(events(), group, head, n_prompt, counts, req.include_usage)


async def _collect(
    req: CompletionRequest,
    state: ServerState,
    group: StreamGroup,
    echoes: list[str],
    head: dict,
    n_prompt: int,
    request: Request,
) -> dict:
    """The non-streaming body, from the same deltas as the stream."""
    n, want_lp = req.n, req.logprobs is not None
    acc = [
        {"index": i, "text": echoes[i // n], "logprobs": None, "finish_reason": None, "n": 0}
        for i in range(len(echoes) * n)
    ]

    def on(item):
        k, d = item
        c = acc[k * n + d.index]
        if want_lp:
            lp = completion_logprobs(state.engine.tokenizer, d, len(c["text"]))
            c["logprobs"] = lp if c["logprobs"] is None else {x: c["logprobs"][x] + lp[x] for x in lp}
        c["text"] += d.text
        c["n"] += len(d.token_ids)
        c["finish_reason"] = d.finish_reason

    await run_collect(group, on, request)
    used = sum(c.pop("n") for c in acc)
    return {**head, "choices": acc, "usage": usage(n_prompt, used)}
