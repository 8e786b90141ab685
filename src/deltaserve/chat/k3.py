"""K3 "XTML" renderer (spec/model.md §14.1): `k3_pieces` produces the `Special` / str pieces
that `common.encode_pieces` turns into ids.

    <|open|>message ATTRS<|sep|> BODY <|close|>message<|sep|><|end_of_msg|>

Choices where §14.1 is silent (also in the module report):
- tool declarations: one leading `role="system" type="tool-declare"` message; the body is the
  header, then "```json\\n" + compact sorted JSON of the tools list as given + "\\n```".
  A system message carrying `tools` mid-conversation renders the same shape with the header
  `## New Tools Available\\n...` (exact upstream wording unverified).
- assistant turns: with thinking on, every assistant turn carries a think element (empty if no
  `reasoning_content`: "always present, may be empty"); with thinking off, think elements are
  omitted. The response element is written when the content is non-empty or there are no calls.
- tool calls: `index` is 1-based within the assistant turn; a tool result message finds its
  tool name / index from the matching `tool_call_id`, else from its own `name` / `index`.
- images: one `<|media_pad|>` per image part (the HF-processor form of §12.6; the model expands
  it to the image's feature rows), or `<|kimi_image_placeholder|>` if the tokenizer defines it.
- control messages (§14.1: thinking_effort, tool_choice, response_format, each an internal
  `role="system" type="…"` message): rendered after the conversation, just before the
  generation prompt, in the order given (the server's: effort, tool choice, format), so a
  conversation prefix is shared by requests that differ only in their controls. Bodies:
  the effort (`low`..`max`), `required` / `none`, `json_object` or
  "json_schema\n```json\n" + compact JSON of the request's json_schema + "\n```"
  (exact upstream bodies and placement unverified).
- no `[BOS]` (OQ-6 open).
"""

from __future__ import annotations

import json

from .common import ChatFormatError, Special, content_items, validate_tool_calls, validate_tools

OPEN, CLOSE, SEP, EOM = (Special("<|open|>"), Special("<|close|>"), Special("<|sep|>"), Special("<|end_of_msg|>"))
IMAGE = Special("<|media_pad|>")
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
NEW_TOOLS_HEADER = "## New Tools Available\nHere are the available tools, described in JSONSchema.\n\n"
ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def compact_json(obj) -> str:
    """Compact JSON, keys sorted recursively, non-ASCII kept (§14.1 tool list)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def json_type(value) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    raise ChatFormatError(f"tool-call argument of type {type(value).__name__} is not JSON")


def open_tag(name: str, attrs: list[tuple[str, str]] = ()) -> list:
    head = name + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs)
    return [OPEN, head, SEP]


def close_tag(name: str) -> list:
    return [CLOSE, name, SEP]


def element(name: str, attrs, body: list) -> list:
    return open_tag(name, attrs) + body + close_tag(name)


def message(attrs, body: list) -> list:
    return element("message", attrs, body) + [EOM]


def _body(items: list, image_special) -> list:
    return [image_special if isinstance(i, tuple) else i for i in items]


def tool_declare(tools: list[dict], header: str = TOOLS_HEADER) -> list:
    try:
        listing = compact_json(tools)
    except (TypeError, ValueError) as e:
        raise ChatFormatError(f"tools are not JSON-serialisable: {e}") from e
    return message([("role", "system"), ("type", "tool-declare")], [header + "```json\n" + listing + "\n```"])


def tool_call(call: dict, index: int) -> list:
    args = call["arguments"]
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            # unparseable (or non-object) argument string: §14.1 json fallback element
            body = element("json", [("type", "object")], [args])
            return element("call", [("tool", call["name"]), ("index", str(index))], body)
        args = parsed
    body: list = []
    for key, value in args.items():
        t = json_type(value)
        text = value if t == "string" else json.dumps(value, ensure_ascii=False)
        body += element("argument", [("key", str(key)), ("type", t)], [text])
    return element("call", [("tool", call["name"]), ("index", str(index))], body)


CONTROL_TYPES = ("thinking_effort", "tool_choice", "response_format")


def control_messages(controls) -> list:
    """`[(type, body)]` -> internal system messages (see the module docstring)."""
    out: list = []
    for item in controls or ():
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and item[0] in CONTROL_TYPES
            and isinstance(item[1], str)
            and item[1]
        ):
            raise ChatFormatError(f"a control message must be (type in {CONTROL_TYPES}, non-empty body), got {item!r}")
        out += message([("role", "system"), ("type", item[0])], [item[1]])
    return out


def k3_pieces(
    messages: list[dict],
    tools: list[dict],
    add_generation_prompt: bool,
    thinking: bool,
    image_special=None,
    controls=(),
) -> list:
    image_special = image_special or IMAGE
    out: list = []
    if tools:
        out += tool_declare(tools)
    call_info: dict[str, tuple[str, int]] = {}  # tool_call_id -> (name, index)
    for i, m in enumerate(messages):
        where, role = f"messages[{i}]", m["role"]
        if role in ("system", "user"):
            mid_tools = m.get("tools")
            if role == "system" and mid_tools is not None:
                out += tool_declare(validate_tools(mid_tools), NEW_TOOLS_HEADER)
                if m.get("content") is None:
                    continue
            items = content_items(m, where, required=True, allow_images=role == "user")
            out += message([("role", role)], _body(items, image_special))
        elif role == "assistant":
            calls = validate_tool_calls(m, where)
            items = content_items(m, where, required=False, allow_images=False)
            body: list = []
            if thinking:
                body += element("think", [], [m.get("reasoning_content") or ""])
            if any(items) or not calls:
                body += element("response", [], items)
            if calls:
                inner: list = []
                for j, c in enumerate(calls, 1):
                    inner += tool_call(c, j)
                    if c["id"] is not None:
                        call_info[c["id"]] = (c["name"], j)
                body += element("tools", [], inner)
            out += message([("role", "assistant")], body)
        else:  # tool
            items = content_items(m, where, required=False, allow_images=False)
            if m.get("content") is None:
                raise ChatFormatError(f"{where} (tool) needs 'content'")
            name, index = call_info.get(m.get("tool_call_id"), (m.get("name"), m.get("index")))
            if not isinstance(name, str) or not name:
                raise ChatFormatError(
                    f"{where} (tool): tool_call_id {m.get('tool_call_id')!r} "
                    "matches no earlier assistant tool call and no 'name' given"
                )
            if isinstance(index, bool) or not isinstance(index, (int, str)):
                index = 1
            out += message([("role", "tool"), ("tool", name), ("index", str(index))], items)
    out += control_messages(controls)
    if add_generation_prompt:
        out += open_tag("message", [("role", "assistant")])
        out += open_tag("think" if thinking else "response")
    return out
