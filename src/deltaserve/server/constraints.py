"""Chat `response_format` / `tool_choice` -> engine `StructuredOutput`, K3 control messages, and
forced-tool-call output -> `tool_calls`.

Forced tool choice follows vLLM: the grammar forces JSON, not tool markup, and the server wraps
it. With a named function (`{"type": "function", "function": {"name": N}}`) the output is N's
arguments (an object valid for its `parameters` schema); with `"required"` it is a non-empty
array of `{"name": one declared tool, "parameters": its arguments}` (at most one element when
`parallel_tool_calls` is false). JSON is format-independent, so one path serves K3 and
Kimi-Linear, and `parsers.py` keeps reading only free-running output.

On K3 with thinking on, reasoning is free and the constraint starts after the think element:
the grammar is "text without control tokens, `<|close|>think<|sep|><|open|>response<|sep|>`,
then JSON", so the reasoning parser splits it as usual and the JSON is the response content.
The request's `thinking_token_budget` (alias `max_reasoning_tokens`) bounds that reasoning (the
engine then forces the think-close, engine/request/reasoning.py); it applies whenever the output starts
in a think element (K3, thinking on), constrained or not, and is ignored otherwise.

A forced tool choice whose output ended ("stop") without the complete JSON call is an error
(`missing_forced_call`), never content with finish "stop"; cut by max_tokens it stays "length".
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..chat.common import ChatFormatError, validate_tools
from ..engine.request.structured import Special, StructuredOutput, StructuredOutputError, tool_call_schema
from .errors import APIError
from .parsers import ToolCall
from .thinking import resolve_thinking

K3_THINK_END = (Special("<|close|>"), "think", Special("<|sep|>"), Special("<|open|>"), "response", Special("<|sep|>"))


@dataclass(frozen=True)
class ChatConstraint:
    """What a chat request forces: `structured` for the engine, `tool` (None: no forced call,
    "" : any declared tool via `"required"`, else the named function), and the K3 control
    messages `controls` (`[(type, body)]`, rendered by `chat/k3.py`)."""

    structured: StructuredOutput | None
    tool: str | None
    controls: tuple = ()
    reasoning_end: tuple = ()
    thinking_budget: int | None = None


def _tool_names(tools, param: str = "tools") -> list[str]:
    try:
        return [t.get("function", t)["name"] for t in validate_tools(tools)]
    except ChatFormatError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def all_tools(req) -> list[dict]:
    """The request's global `tools` then every dynamic tool (a `system` message's `tools`, K3's
    mid-conversation declaration). Only system messages may carry tools, such a message has
    empty content, and names are unique across all of them; else `APIError(400)` naming the field."""
    names = _tool_names(req.tools)
    tools = list(req.tools or [])
    seen = set()
    for i, m in enumerate(req.messages):
        if not isinstance(m, dict) or m.get("tools") is None:
            continue
        where = f"messages[{i}].tools"
        if m.get("role") != "system":
            raise APIError(400, f"{where}: only system messages may declare tools", param=where)
        if m.get("content") not in (None, ""):
            raise APIError(400, f"messages[{i}]: a system message declaring tools must have empty content", param=where)
        names += _tool_names(m["tools"], where)
        tools += m["tools"]
    for name in names:
        if name in seen:
            raise APIError(
                400,
                f"tool name {name!r} is declared twice (global and dynamic tools share one namespace)",
                param="tools",
            )
        seen.add(name)
    return tools


def chat_constraint(req, family: str, thinking: bool) -> ChatConstraint:
    """Validate and map the request's forcing fields; raises `APIError(400)` on bad combinations."""
    rf = req.response_format
    choice = req.tool_choice
    tools = all_tools(req)
    names = _tool_names(tools)
    forced = None
    if choice == "required":
        if not names:
            raise APIError(400, 'tool_choice "required" needs a non-empty tools list', param="tool_choice")
        forced = ""
    elif choice is not None and not isinstance(choice, str):
        forced = choice.function.name
        if forced not in names:
            raise APIError(400, f"tool_choice names function {forced!r}, which is not in tools", param="tool_choice")
    fmt = rf.type if rf is not None else "text"
    if forced is not None and fmt != "text":
        raise APIError(400, "response_format cannot be combined with a forced tool_choice", param="response_format")
    prefix = K3_THINK_END if family == "kimi_k3" and thinking else ()
    budget = _budget(req) if prefix else None
    try:
        if forced is not None:
            schema = tool_call_schema(tools, forced or None)
            if forced == "" and req.parallel_tool_calls is False:
                schema = {**schema, "maxItems": 1}
            structured = StructuredOutput.json(schema, prefix)
        elif fmt == "json_object":
            structured = StructuredOutput.json(None, prefix)
        elif fmt == "json_schema":
            if rf.json_schema is None:
                raise APIError(
                    400, 'response_format "json_schema" needs a json_schema object', param="response_format.json_schema"
                )
            if rf.json_schema.schema_ is None:
                raise APIError(
                    400,
                    'response_format "json_schema" needs json_schema.schema (a JSON Schema object)',
                    param="response_format.json_schema.schema",
                )
            structured = StructuredOutput.json(rf.json_schema.schema_, prefix)
        else:
            structured = None
    except StructuredOutputError as e:
        raise APIError(400, str(e), param="tool_choice" if forced is not None else "response_format") from None
    return ChatConstraint(structured, forced, _controls(req, thinking), prefix, budget)


def _budget(req) -> int | None:
    a, b = req.thinking_token_budget, req.max_reasoning_tokens
    if a is not None and b is not None and a != b:
        raise APIError(
            400,
            "thinking_token_budget and max_reasoning_tokens are aliases; give one (or the same value)",
            param="thinking_token_budget",
        )
    return a if a is not None else b


def missing_forced_call(index: int) -> str:
    """The error message for choice `index` of a forced tool choice that made no call."""
    return (
        f"tool_choice forces a tool call, but choice {index} ended without the complete call "
        f"(e.g. a stop string cut it)"
    )


def _controls(req, thinking: bool) -> tuple:
    """K3 control messages (`chat/k3.py` renders and places them): the effort (thinking on and
    one given, `thinking.py`), tool choice "required" (also for a named function) / "none" when
    tools are declared, and the response format."""
    out = []
    effort = resolve_thinking(req).effort
    if effort is not None and thinking:
        out.append(("thinking_effort", effort))
    choice = req.tool_choice
    if all_tools(req) and choice is not None and choice != "auto":
        out.append(("tool_choice", "none" if choice == "none" else "required"))
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", "json_object"))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        out.append(("response_format", rf.json_schema.schema_))
    return tuple(out)


def forced_tool_calls(content: str, tool: str, family: str) -> list[ToolCall] | None:
    """The tool calls in a forced-choice output (see module docstring); None if `content` is not
    the complete JSON the grammar forces (e.g. cut by max_tokens)."""
    try:
        value = json.loads(content)
    except ValueError:
        return None
    base = 1 if family == "kimi_k3" else 0
    if tool:
        if not isinstance(value, dict):
            return None
        return [ToolCall(f"functions.{tool}:{base}", tool, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for i, item in enumerate(value):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("name"), str)
            or not isinstance(item.get("parameters"), dict)
        ):
            return None
        name = item["name"]
        calls.append(ToolCall(f"functions.{name}:{base + i}", name, json.dumps(item["parameters"], ensure_ascii=False)))
    return calls
