"""OpenAI-compatible HTTP routes: `build_app(engine, served_model_name, api_key=None)`.

Routes: `/v1/completions`, `/v1/chat/completions` (JSON or SSE with `data: [DONE]`),
`/v1/models`, `/tokenize`, `/detokenize`, `/health` (process up; never needs the key) and
`/ready` (the engine thread answered a round trip), `/metrics` (Prometheus, see `metrics.py`).
With `max_waiting_requests` set, a generation request arriving while that many are queued gets
429 with `Retry-After`, before any work. Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`; messages never carry internals (an unexpected
exception is logged and answered 500 `server_error`, see `middleware.py`, which also checks the
API key before the body is read). A non-streaming generation whose client disconnects is
aborted (`disconnect.py`); a stream that fails ends with an error event, then `[DONE]`.
Non-streaming responses are assembled from the same delta stream as streaming ones, so the
two agree for the same seed. Text prompts are encoded with special tokens disallowed.
The completion route is in `completions.py`; `response_format` / `tool_choice` are mapped to
engine constraints (and K3 control messages) in `constraints.py`.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.sampling_params import SamplingParams, SamplingParamsError
from ..engine.sequence import InvalidRequestError
from ..model.tokenizer import TokenizerError
from .async_engine import AsyncEngine, EngineDeadError, GenerationError, RequestStream
from .chat import ChatFormatError, render_chat
from .completions import RouteContext, add_completion_routes
from .constraints import chat_constraint, forced_tool_calls, missing_forced_call
from .disconnect import ClientDisconnected, until_disconnect
from .errors import APIError, BodyLimit, public_message, validation_message
from .metrics import Metrics
from .middleware import ApiKeyAuth, ErrorGuard
from .parsers import StreamingParser, control_token_ids, parse_output
from .protocol import MAX_BODY_BYTES, ChatRequest, DetokenizeRequest, TokenizeRequest, error_body

log = logging.getLogger(__name__)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, max_waiting_requests: int | None = None,
              retry_after_s: int = 1) -> FastAPI:
    """The FastAPI app over a started-or-not `AsyncEngine` (started on app start-up);
    `max_waiting_requests=None` means no queue cap."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield

    app = FastAPI(title="deltaserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, key=api_key)
    app.add_middleware(ErrorGuard)
    tok = engine.tokenizer
    metrics = app.state.metrics = Metrics(served_model_name)

    def admit() -> None:
        if max_waiting_requests is not None and engine.queue_load() >= max_waiting_requests:
            metrics.rejected.inc()
            raise APIError(429, "the server is overloaded: too many waiting requests; retry later",
                           "rate_limit_error", code="too_many_waiting_requests",
                           headers={"Retry-After": str(retry_after_s)})

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return JSONResponse(error_body(msg, param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), exc.status_code)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"the model {name!r} does not exist", "not_found_error", "model",
                           "model_not_found")

    def make_params(kw: dict, **extra) -> SamplingParams:
        try:
            return SamplingParams(**kw, **extra)
        except SamplingParamsError as e:
            raise APIError(400, str(e)) from None

    async def submit(ids: list[int], params: SamplingParams) -> RequestStream:
        try:
            stream = await engine.add(ids, params)
        except (InvalidRequestError, SamplingParamsError) as e:
            raise APIError(400, str(e)) from None
        except EngineDeadError:
            raise APIError(503, "the engine is not running", "service_unavailable") from None
        stream.observer = metrics.track(len(ids), params.n)
        return stream

    def require_tokenizer():
        if tok is None:
            raise APIError(400, "this model was loaded without a tokenizer")
        return tok

    def chat_prompt(messages, tools, thinking: bool, controls=()) -> list[int]:
        try:
            return render_chat(require_tokenizer(), engine.family, messages, tools=tools,
                               thinking=thinking, chat_template=engine.chat_template,
                               controls=controls, accept_images=False)
        except ChatFormatError as e:
            raise APIError(400, str(e), param="messages") from None

    def usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def drain(stream: RequestStream, on_delta) -> None:
        """Feed every delta to `on_delta`; abort the request if we stop early."""
        try:
            async for d in stream:
                on_delta(d)
        finally:
            stream.abort()

    async def sse_stream(body, stream: RequestStream, head: dict, prompt_len: int, counts: list[int],
                         include_usage: bool):
        """SSE framing shared by both endpoints: the body's chunks, then the usage chunk, an
        error event if anything failed (`public_message`), `[DONE]`; chunks are encoded here, so
        an encoding failure is such a failure too; the request is aborted however it ends."""
        try:
            async for item in body:
                yield item.encode()
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage(prompt_len, sum(counts))}).encode()
        except Exception as e:
            yield _sse(error_body(public_message(e), "server_error")).encode()
        finally:
            stream.abort()
        yield b"data: [DONE]\n\n"

    async def run_collect(stream, on, request: Request) -> None:
        """`drain`, aborted if the client disconnects first (answered 499, which nobody reads)."""
        try:
            await until_disconnect(request, drain(stream, on))
        except ClientDisconnected:
            raise APIError(499, "the client closed the connection", code="client_closed_request") from None
        except Exception as e:
            raise APIError(500, public_message(e), "server_error") from None

    add_completion_routes(app, RouteContext(
        tok, served_model_name, admit, check_model, make_params, submit, require_tokenizer, usage,
        _sse, sse_stream, run_collect))

    # ------------------------------------------------------------ chat

    def chat_logprobs(d, k: int) -> list[dict]:
        out = []
        for t, entry in zip(d.token_ids, d.logprobs or []):
            def item(tid, lp):
                b = tok.token_bytes(tid)
                return {"token": lp.decoded_token or "", "logprob": lp.logprob, "bytes": list(b)}
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
            out.append({**item(t, entry[t]), "top_logprobs": [item(a, b) for a, b in top]})
        return out

    def tool_call_json(call, index: int | None = None) -> dict:
        out = {"id": call.id, "type": "function",
               "function": {"name": call.name, "arguments": call.arguments_json}}
        return out if index is None else {"index": index, **out}

    def forced_finish(cons, finish: str | None, called: bool) -> str | None:
        """OpenAI's finish reasons: "tool_calls" after free or "required" calls, "stop" after a
        call to a named (forced) function."""
        if finish == "stop" and called and cons.tool != "" and cons.tool is not None:
            return "stop"
        return "tool_calls" if finish == "stop" and called else finish

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        admit()
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            kw = req.sampling_kwargs()
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        tkw = req.chat_template_kwargs.thinking if req.chat_template_kwargs else None
        thinking = next((v for v in (req.thinking, tkw) if v is not None), True)
        family = engine.family
        cons = chat_constraint(req, family, thinking)
        declared = bool(req.tools) and req.tool_choice != "none"
        shown = req.tools if declared or (family == "kimi_k3" and req.tools) else None
        ids = chat_prompt(req.messages, shown, thinking, cons.controls)
        top_k = req.top_logprobs or 0
        params = make_params(kw, max_tokens=req.max_completion_tokens or req.max_tokens,
                             logprobs=top_k if req.logprobs else None, structured=cons.structured,
                             keep_special_token_ids=control_token_ids(tok, family),
                             reasoning_end=cons.reasoning_end, thinking_token_budget=cons.thinking_budget)
        stream = await submit(ids, params)
        think = thinking and family == "kimi_k3"
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": served_model_name}
        if req.stream:
            return StreamingResponse(chat_events(req, stream, ids, head, declared, think, top_k, cons),
                                     media_type="text/event-stream")
        acc = [{"text": "", "lp": [], "n": 0, "finish": None} for _ in range(req.n)]

        def on(d):
            c = acc[d.index]
            c["text"] += d.text
            c["n"] += len(d.token_ids)
            c["finish"] = d.finish_reason
            if req.logprobs:
                c["lp"] += chat_logprobs(d, top_k)
        await run_collect(stream, on, request)
        choices = []
        for i, c in enumerate(acc):
            p = parse_output(c["text"], family, declared, think)
            calls, content = p.tool_calls, p.content
            if cons.tool is not None:
                forced = forced_tool_calls(content, cons.tool, family)
                if forced:
                    calls, content = forced, ""
                elif c["finish"] == "stop":
                    raise APIError(500, missing_forced_call(i), "server_error")
            msg = {"role": "assistant", "content": content or None,
                   "reasoning_content": p.reasoning_content or None}
            if calls:
                msg["tool_calls"] = [tool_call_json(t) for t in calls]
            choices.append({"index": i, "message": msg,
                            "finish_reason": forced_finish(cons, c["finish"], bool(calls)),
                            "logprobs": {"content": c["lp"]} if req.logprobs else None})
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage(len(ids), sum(c["n"] for c in acc))}

    def chat_events(req, stream, ids, head, declared, think, top_k, cons):
        """SSE chunks. With a forced tool choice the response content (the forced JSON) is held
        back and sent at the end as whole tool calls (as content if cut by max_tokens; an error
        event if it ended without the call)."""
        head = {**head, "object": "chat.completion.chunk"}
        parsers = [StreamingParser(engine.family, declared, think) for _ in range(req.n)]
        ncalls, counts, held = [0] * req.n, [0] * req.n, [""] * req.n

        def chunk(i, delta, finish=None, lp=None):
            return _sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish}]})

        async def body():
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for d in stream:
                i = d.index
                counts[i] += len(d.token_ids)
                parts = parsers[i].feed(d.text) + (parsers[i].finish() if d.finish_reason else [])
                delta: dict = {}
                for p in parts:
                    if p.kind == "tool_call":
                        delta.setdefault("tool_calls", []).append(tool_call_json(p.tool_call, ncalls[i]))
                        ncalls[i] += 1
                    elif p.kind == "content" and cons.tool is not None:
                        held[i] += p.text
                    elif p.text:
                        name = "content" if p.kind == "content" else "reasoning_content"
                        delta[name] = delta.get(name, "") + p.text
                if d.finish_reason and cons.tool is not None:
                    forced = forced_tool_calls(held[i], cons.tool, engine.family)
                    if forced:
                        for t in forced:
                            delta.setdefault("tool_calls", []).append(tool_call_json(t, ncalls[i]))
                            ncalls[i] += 1
                    elif d.finish_reason == "stop":
                        raise GenerationError(missing_forced_call(i))
                    elif held[i]:
                        delta["content"] = delta.get("content", "") + held[i]
                lp = {"content": chat_logprobs(d, top_k)} if req.logprobs and d.token_ids else None
                finish = forced_finish(cons, d.finish_reason, bool(ncalls[i]))
                if delta or lp or finish:
                    yield chunk(i, delta, finish, lp)
        return sse_stream(body(), stream, head, len(ids), counts, req.include_usage)

    # ------------------------------------------------------------ misc routes

    def model_card() -> dict:
        return {"id": served_model_name, "object": "model", "created": 0, "owned_by": "deltaserve",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        ids = require_tokenizer().encode(req.prompt) if req.prompt is not None else \
            chat_prompt(req.messages, None, True)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        try:
            return {"prompt": require_tokenizer().decode(req.tokens)}
        except TokenizerError as e:
            raise APIError(400, str(e), param="tokens") from None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, ctype = await metrics.render(engine)
        return Response(body, media_type=ctype)

    @app.get("/ready")
    async def ready():
        try:
            stats = await engine.call(lambda core: core.stats(), timeout=5.0)
        except Exception:
            raise APIError(503, "the engine did not answer", "service_unavailable") from None
        return {"status": "ready", "num_running": stats["num_running"],
                "num_waiting": stats["num_waiting"]}

    return app
