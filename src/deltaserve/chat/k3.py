"""K3 "XTML" renderer (spec/model.md §14.1): `k3_pieces` produces the `Special` / str pieces
that `common.encode_segments` turns into ids, each str piece encoded ON ITS OWN (the reference
encoder tokenizes segment by segment, so BPE never merges across a tag name, an attribute key,
`="`, its value and `"`).

    <|open|>message ATTRS<|sep|> BODY <|close|>message<|sep|><|end_of_msg|>

Rules (facts of the public reference encoder, `encoding_k3.build_chat_segments`):
- order: the tool declaration (`type="tool-declare"`, header + fenced compact deep-sorted JSON of
  the tools list), then the thinking-effort message (thinking on and an effort given), then the
  conversation, then the tool-choice and response-format messages, then the generation prompt
  `<|open|>message role="assistant"<|sep|><|open|>think|response<|sep|>`.
- a system message with `tools` is a dynamic declaration (the "New Tools Available" body) and
  renders nothing else; user / system messages carry `name="…"` when given.
- assistant turns: with thinking on a think element (its `reasoning_content`, may be empty),
  always a response element (the content, may be empty), then the tools element when there are
  calls (`call tool="NAME" index="i"`, arguments per `k3_values.call_arguments`).
- tool results: each run of tool messages is put in the preceding calls' order when every one
  matches a call id (the name then comes from the call); `index` counts the results since the
  last assistant turn; the name is the message's own `tool` / `name`, else the call at that index.
- internal messages' bodies are stripped; attribute values escape `&` then `"` only.
- images (user and tool messages): one image special per part (expanded by the engine).
- `partial` on the last (assistant) message: it is left open as the generation prompt (its
  think element closed when its content or calls started; the response element left open).
"""

from __future__ import annotations

from .common import ChatFormatError, Special, content_items, validate_tool_calls, validate_tools
from .k3_values import call_arguments, compact_json, deep_sort

OPEN, CLOSE, SEP, EOM = (Special("<|open|>"), Special("<|close|>"), Special("<|sep|>"), Special("<|end_of_msg|>"))
IMAGE = Special("<|media_pad|>")
TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
DYNAMIC_TOOLS_BODY = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
)
EFFORTS = ("low", "high", "max")
EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={}`."
)
TOOL_CHOICE_BODY = "The system is invoked with `tool_choice={}`.\nYou MUST {} in the next message."
JSON_BODY = (
    "The system is invoked with `response_format={}`.\nYour response must be raw JSON data without "
    "markdown code blocks (```json) or any additional formatting."
)
SCHEMA_TAIL = "\nThe JSON data must match the following schema:\n```json\n{}\n```"
CONTROL_TYPES = ("thinking_effort", "tool_choice", "response_format")


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def open_tag(name: str, attrs=()) -> list:
    out: list = [OPEN, name]
    for k, v in attrs:
        out += [f" {k}", '="', escape_attr(str(v)), '"']
    return out + [SEP]


def close_tag(name: str) -> list:
    return [CLOSE, name, SEP]


def element(name: str, attrs, body: list) -> list:
    return open_tag(name, attrs) + body + close_tag(name)


def message(attrs, body: list) -> list:
    return element("message", attrs, body) + [EOM]


def internal(kind: str, body: str) -> list:
    return message([("role", "system"), ("type", kind)], [body.strip()])


def tool_declare(tools: list, dynamic: bool = False) -> list:
    body = (DYNAMIC_TOOLS_BODY if dynamic else TOOLS_BODY) + "```json\n" + compact_json(deep_sort(tools)) + "\n```"
    return message([("role", "system"), ("type", "tool-declare")], [body])


def tool_call(call: dict, index: int) -> list:
    kind, args = call_arguments(call["arguments"])
    if kind == "json":
        body = element("json", [("type", "object")], [args])
    else:
        body = [p for key, t, text in args for p in element("argument", [("key", key), ("type", t)], [text])]
    return element("call", [("tool", call["name"]), ("index", index)], body)


def controls_split(controls) -> tuple[list, list]:
    """`[(type, value)]` -> (pieces before the conversation, pieces after it). Values: an effort
    in `EFFORTS`; a tool choice "required" / "none"; a format "json_object" or a dict (the
    json_schema's schema)."""
    head: list = []
    tail: list = []
    for item in controls or ():
        kind, value = item if isinstance(item, tuple) and len(item) == 2 else (None, None)
        if kind == "thinking_effort" and value in EFFORTS:
            head += internal("thinking-effort", EFFORT_BODY.format(value))
        elif kind == "tool_choice" and value in ("required", "none"):
            what = "call tools" if value == "required" else "NOT call any tools"
            tail += internal("tool-choice", TOOL_CHOICE_BODY.format(value, what))
        elif kind == "response_format" and value == "json_object":
            tail += internal("response-format", JSON_BODY.format("json_object"))
        elif kind == "response_format" and isinstance(value, dict):
            schema = compact_json(deep_sort(value))
            tail += internal("response-format", JSON_BODY.format("json_schema") + SCHEMA_TAIL.format(schema))
        else:
            raise ChatFormatError(f"a control message must be (type in {CONTROL_TYPES}, valid value), got {item!r}")
    return head, tail


def order_tool_results(messages: list[dict]) -> list[dict]:
    """Each run of tool messages in its calls' order, named from the call, when all match."""
    out: list[dict] = []
    calls: dict = {}
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "assistant":
            calls = {}
            for pos, c in enumerate(validate_tool_calls(m, f"messages[{i}]"), 1):
                if c["id"] is not None:
                    calls.setdefault(c["id"], (pos, c["name"]))
        if m["role"] != "tool":
            out.append(m)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        run = messages[i:j]
        if all(r.get("tool_call_id") in calls for r in run):
            run = sorted(run, key=lambda r: calls[r["tool_call_id"]][0])
            run = [{**r, "tool": calls[r["tool_call_id"]][1]} for r in run]
        out += run
        i = j
    return out


def _named(role: str, m: dict) -> list:
    return [("role", role)] + ([("name", m["name"])] if isinstance(m.get("name"), str) and m["name"] else [])


def _body(items: list, image_special) -> list:
    return [image_special if isinstance(i, tuple) else i for i in items if i != ""]


def assistant_body(m: dict, where: str, thinking: bool, partial: bool = False) -> list:
    calls = validate_tool_calls(m, where)
    if partial and calls:
        raise ChatFormatError(f"{where}: a partial (prefilled) assistant message cannot carry tool_calls")
    items = content_items(m, where, required=False, allow_images=False)
    body: list = []
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    started = bool(calls) or any(items)
    if thinking:
        body += open_tag("think") + ([reasoning] if isinstance(reasoning, str) and reasoning else [])
        if partial and not started:
            return body
        body += close_tag("think")
    body += open_tag("response") + [i for i in items if i]
    if partial and not calls:
        return body
    body += close_tag("response")
    if calls:
        inner = [p for j, c in enumerate(calls, 1) for p in tool_call(c, j)]
        body += element("tools", [], inner)
    return body


def _tool_message(m: dict, where: str, index: int, prior: list, image_special) -> list:
    if m.get("content") is None:
        raise ChatFormatError(f"{where} (tool) needs 'content'")
    name = m.get("tool", m.get("name"))
    if name is None and index <= len(prior):
        name = prior[index - 1]["name"]
    if not isinstance(name, str) or not name:
        raise ChatFormatError(
            f"{where} (tool): its tool_call_id {m.get('tool_call_id')!r} matches no call of the "
            "preceding assistant turn and it gives no 'name'"
        )
    items = content_items(m, where, required=False, allow_images=True)
    return message([("role", "tool"), ("tool", name), ("index", index)], _body(items, image_special))


def _partial(messages: list[dict]) -> bool:
    """Whether the last message is a prefilled assistant turn (`"partial": true`); a `partial`
    anywhere else, or not a boolean, is refused."""
    for i, m in enumerate(messages):
        p = m.get("partial")
        if p is None:
            continue
        if not isinstance(p, bool):
            raise ChatFormatError(f"messages[{i}].partial must be a boolean")
        if p and (i != len(messages) - 1 or m["role"] != "assistant"):
            raise ChatFormatError(f"messages[{i}].partial: only the last message, an assistant one, may be partial")
    return messages[-1].get("partial") is True


def k3_pieces(
    messages: list[dict],
    tools: list[dict],
    add_generation_prompt: bool,
    thinking: bool,
    image_special=None,
    controls=(),
) -> list:
    image_special = image_special or IMAGE
    head, tail = controls_split(controls)
    out: list = tool_declare(tools) if tools else []
    out += head if thinking else []
    prior: list = []
    tool_index = 0
    partial = _partial(messages)
    ordered = order_tool_results(messages)
    for i, m in enumerate(ordered[:-1] if partial else ordered):
        where, role = f"messages[{i}]", m["role"]
        if role == "system" and m.get("tools"):
            out += tool_declare(validate_tools(m["tools"]), dynamic=True)
        elif role in ("system", "user"):
            items = content_items(m, where, required=True, allow_images=role == "user")
            out += message(_named(role, m), _body(items, image_special))
        elif role == "assistant":
            prior, tool_index = validate_tool_calls(m, where), 0
            out += message(_named("assistant", m), assistant_body(m, where, thinking))
        else:
            tool_index += 1
            out += _tool_message(m, where, tool_index, prior, image_special)
    out += tail
    if partial:
        m = ordered[-1]
        body = assistant_body(m, f"messages[{len(ordered) - 1}]", thinking, partial=True)
        return out + open_tag("message", _named("assistant", m)) + body
    if add_generation_prompt:
        out += open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")
    return out


def uncounted_prompt_tokens(thinking: bool, partial: bool) -> int:
    """Prompt tokens Moonshot's API leaves out of `usage.prompt_tokens`: in non-thinking mode the
    response-channel opener the server forces (`<|open|>response<|sep|>`, 3 ids) is not counted
    (the vendor ground truths 36 and 119 are the rendered prompt less these 3; thinking-mode
    ground truths count the whole prompt)."""
    return 0 if thinking or partial else 3
