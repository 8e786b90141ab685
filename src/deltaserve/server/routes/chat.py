"""`POST /v1/chat/completions`: JSON or SSE (`data: [DONE]`), `n` samples, logprobs, tools.

The prompt is rendered on a worker thread (`ServerState.chat_prompt`), its images (K3 with a
vision tower) fetched, decoded and preprocessed off the loop (`ServerState.chat_images`,
`media.py`) after every cheaper check; `response_format` /
`tool_choice` become engine constraints and K3 control messages (`constraints.py`). The output
is split into reasoning, content and tool calls by `parsers.py` (streamed: `StreamingParser`,
else `parse_output`; the two agree). With a forced tool choice the output is the call's JSON,
wrapped into `tool_calls` here; a forced call that never came is an error.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ...chat.k3 import uncounted_prompt_tokens
from ..channel_guard import channel_guard
from ..constraints import ChatConstraint, all_tools, chat_constraint, forced_tool_calls, missing_forced_call
from ..errors import APIError
from ..parsers import StreamingParser, control_token_ids, parse_output
from ..protocol import ChatRequest
from ..request_stream import GenerationError
from ..sampling_policy import apply_policy
from ..state import State
from ..thinking import resolve_thinking
from .common import check_request, run_collect, sampling_kwargs, sse, sse_stream, usage

router = APIRouter()


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request settled before generation: how to read and report its output."""

    family: str
    cons: ChatConstraint
    declared: bool  # tools declared and tool_choice != "none": tool calls are parsed
    think: bool  # the output starts in a think element (K3, thinking on)
    top_k: int  # top_logprobs per token
    logprobs: bool
    tok: Any  # the tokenizer


def _thinking(req: ChatRequest) -> bool:
    return resolve_thinking(req).on


def _prefilled(req: ChatRequest) -> bool:
    """Whether the last message is a prefilled (`"partial": true`) assistant turn."""
    last = req.messages[-1]
    return last.get("role") == "assistant" and last.get("partial") is True


def _starts_in_think(req: ChatRequest, thinking: bool) -> bool:
    """Whether the output continues a think element: thinking on, unless the last message is a
    partial assistant turn whose response (content) already started."""
    if thinking and _prefilled(req):
        return not req.messages[-1].get("content")
    return thinking


def chat_logprobs(plan: ChatPlan, d) -> list[dict]:
    out = []
    for t, entry in zip(d.token_ids, d.logprobs or []):

        def item(tid, lp):
            b = plan.tok.token_bytes(tid)
            return {"token": lp.decoded_token or "", "logprob": lp.logprob, "bytes": list(b)}

        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: plan.top_k]
        out.append({**item(t, entry[t]), "top_logprobs": [item(a, b) for a, b in top]})
    return out


def tool_call_json(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def forced_finish(cons: ChatConstraint, finish: str | None, called: bool) -> str | None:
    """OpenAI's finish reasons: "tool_calls" after free or "required" calls, "stop" after a
    call to a named (forced) function."""
    if finish == "stop" and called and cons.tool != "" and cons.tool is not None:
        return "stop"
    return "tool_calls" if finish == "stop" and called else finish


def _reasoning_omitted(messages: list[dict]) -> bool:
    """Whether an earlier (not prefilled) assistant turn comes without its reasoning."""
    return any(
        m.get("role") == "assistant"
        and m.get("partial") is not True
        and not (m.get("reasoning_content") or m.get("reasoning"))
        for m in messages
    )


def _structured(state, plan: ChatPlan, req: ChatRequest):
    """The request's own constraint, else (K3 with `--channel-guard`) the channel guard."""
    if plan.cons.structured is not None or not state.channel_guard or plan.family != "kimi_k3":
        return plan.cons.structured
    names = [t.get("function", t)["name"] for t in all_tools(req)] if plan.declared else []
    return channel_guard(plan.think, names)


async def chat_prompt_ids(
    req: ChatRequest, state, thinking: bool | None = None
) -> tuple[list[int], ChatConstraint, bool, bool]:
    """The rendered prompt's ids (before images are expanded), the constraint, whether tool
    calls are parsed, and whether the output starts in a think element. `thinking`: the request's
    resolved thinking mode, if the caller has it (`_thinking`)."""
    thinking = _thinking(req) if thinking is None else thinking
    family = state.engine.family
    think = _starts_in_think(req, thinking)
    cons = chat_constraint(req, family, think)
    declared = bool(all_tools(req)) and req.tool_choice != "none"
    shown = req.tools if declared or (family == "kimi_k3" and req.tools) else None
    ids = await state.chat_prompt(req.messages, shown, thinking, cons.controls)
    return ids, cons, declared, think


def counted_prompt_tokens(req: ChatRequest, family: str, n_ids: int, thinking: bool) -> int:
    """`usage.prompt_tokens` for a prompt of `n_ids` ids (K3: Moonshot's accounting,
    `chat.k3.uncounted_prompt_tokens`)."""
    if family != "kimi_k3":
        return n_ids
    return n_ids - uncounted_prompt_tokens(thinking, _prefilled(req))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, request: Request, state: State):
    state.admit()
    state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    thinking = _thinking(req)
    kw = apply_policy(state.sampling_policy, req, sampling_kwargs(req), thinking)
    ids, cons, declared, think = await chat_prompt_ids(req, state, thinking)
    if state.engine.family == "kimi_k3" and thinking and _reasoning_omitted(req.messages):
        state.metrics.reasoning_omitted.inc()
    plan = ChatPlan(
        state.engine.family,
        cons,
        declared,
        think and state.engine.family == "kimi_k3",
        req.top_logprobs or 0,
        bool(req.logprobs),
        state.engine.tokenizer,
    )
    params = state.make_params(
        kw,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        logprobs=plan.top_k if req.logprobs else None,
        structured=_structured(state, plan, req),
        keep_special_token_ids=control_token_ids(plan.tok, plan.family),
        reasoning_end=cons.reasoning_end,
        thinking_token_budget=cons.thinking_budget,
    )
    ids, images = await state.chat_images(req.messages, ids)
    limit_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    check_request(state, req, [len(ids)], params.max_tokens, limit_param)
    stream = await state.submit(ids, params, images, req.cache_salt)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.model_name}
    counted = counted_prompt_tokens(req, plan.family, len(ids), thinking)
    if req.stream:
        return StreamingResponse(chat_events(req, plan, stream, counted, head), media_type="text/event-stream")
    return await chat_response(req, plan, stream, counted, head, request)


async def chat_response(
    req: ChatRequest, plan: ChatPlan, stream, prompt_len: int, head: dict, request: Request
) -> dict:
    """The non-streaming body: every delta collected, then each choice parsed whole."""
    acc = [{"text": "", "lp": [], "n": 0, "finish": None} for _ in range(req.n)]

    def on(d):
        c = acc[d.index]
        c["text"] += d.text
        c["n"] += len(d.token_ids)
        c["finish"] = d.finish_reason
        if plan.logprobs:
            c["lp"] += chat_logprobs(plan, d)

    await run_collect(stream, on, request)
    choices = [chat_choice(plan, i, c) for i, c in enumerate(acc)]
    return {
        **head,
        "object": "chat.completion",
        "choices": choices,
        "usage": usage(prompt_len, sum(c["n"] for c in acc)),
    }


def chat_choice(plan: ChatPlan, i: int, c: dict) -> dict:
    p = parse_output(c["text"], plan.family, plan.declared, plan.think)
    calls, content = p.tool_calls, p.content
    if plan.cons.tool is not None:
        forced = forced_tool_calls(content, plan.cons.tool, plan.family)
        if forced:
            calls, content = forced, ""
        elif c["finish"] == "stop":
            raise APIError(500, missing_forced_call(i), "server_error")
    msg = {"role": "assistant", "content": content or None, "reasoning_content": p.reasoning_content or None}
    if calls:
        msg["tool_calls"] = [tool_call_json(t) for t in calls]
    return {
        "index": i,
        "message": msg,
        "finish_reason": forced_finish(plan.cons, c["finish"], bool(calls)),
        "logprobs": {"content": c["lp"]} if plan.logprobs else None,
    }


def chat_events(req: ChatRequest, plan: ChatPlan, stream, prompt_len: int, head: dict):
    """SSE chunks. With a forced tool choice the response content (the forced JSON) is held
    back and sent at the end as whole tool calls (as content if cut by max_tokens; an error
    event if it ended without the call)."""
    head = {**head, "object": "chat.completion.chunk"}
    parsers = [StreamingParser(plan.family, plan.declared, plan.think) for _ in range(req.n)]
    ncalls, counts, held = [0] * req.n, [0] * req.n, [""] * req.n

    def chunk(i, delta, finish=None, lp=None):
        return sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

    def add_calls(delta: dict, i: int, calls) -> None:
        for t in calls:
            delta.setdefault("tool_calls", []).append(tool_call_json(t, ncalls[i]))
            ncalls[i] += 1

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
                    add_calls(delta, i, [p.tool_call])
                elif p.kind == "content" and plan.cons.tool is not None:
                    held[i] += p.text
                elif p.text:
                    name = "content" if p.kind == "content" else "reasoning_content"
                    delta[name] = delta.get(name, "") + p.text
            if d.finish_reason and plan.cons.tool is not None:
                forced = forced_tool_calls(held[i], plan.cons.tool, plan.family)
                if forced:
                    add_calls(delta, i, forced)
                elif d.finish_reason == "stop":
                    raise GenerationError(missing_forced_call(i))
                elif held[i]:
                    delta["content"] = delta.get("content", "") + held[i]
            lp = {"content": chat_logprobs(plan, d)} if plan.logprobs and d.token_ids else None
            finish = forced_finish(plan.cons, d.finish_reason, bool(ncalls[i]))
            if delta or lp or finish:
                yield chunk(i, delta, finish, lp)

    return sse_stream(body(), stream, head, prompt_len, counts, req.include_usage)
