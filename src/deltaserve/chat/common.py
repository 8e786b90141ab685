"""The pieces every chat format shares: `ChatFormatError`, `Special` (a control token by name),
`encode_pieces` (the one place pieces become ids) and the validation of messages, content parts,
tool calls and tool declarations. Imports nothing from the format modules.

Invariant: control (special) tokens come only from a renderer. Every renderer produces a
sequence of `Special(name)` and plain-text pieces; adjacent plain-text pieces are joined and
encoded with specials *disallowed*, so a user typing `<|open|>` gets ordinary BPE ids. Joining
first means the ids equal those of "render the string, tokenize it allowing specials only where
the renderer put them" (no extra BPE boundaries at attribute / body seams).
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_file")


class ChatFormatError(ValueError):
    """The request's messages / tools cannot be rendered (bad role, content or types). `param`:
    the offending field's path (e.g. `messages[2].tool_call_id`) where one is named, else None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Special:
    """A control token, resolved by name against the tokenizer at encode time."""

    name: str


def encode_pieces(tokenizer, pieces) -> list[int]:
    """Encode a sequence of `Special` / `str` pieces (see the module docstring)."""
    ids: list[int] = []
    buf: list[str] = []

    def flush():
        if buf:
            ids.extend(tokenizer.encode("".join(buf), allow_special=False))
            buf.clear()

    for p in pieces:
        if isinstance(p, Special):
            flush()
            tid = tokenizer.special_tokens.get(p.name)
            if tid is None:
                raise ChatFormatError(f"the tokenizer has no special token {p.name!r}, which this chat format needs")
            ids.append(tid)
        else:
            buf.append(p)
    flush()
    return ids


def encode_segments(tokenizer, pieces) -> list[int]:
    """Encode `Special` / `str` pieces with every str encoded on its own (no joining): the K3
    reference encoder's segment-by-segment tokenization."""
    ids: list[int] = []
    for p in pieces:
        if isinstance(p, Special):
            ids += encode_pieces(tokenizer, [p])
        elif p:
            ids += tokenizer.encode(p, allow_special=False)
    return ids


# ---------------------------------------------------------------- validation


def _text_of_parts(parts: list, where: str, allow_images: bool) -> list:
    """Validate a list of content parts; return a list of str / ("image",) items."""
    out: list = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ChatFormatError(f"{where}.content[{j}] must be an object, got {type(part).__name__}")
        ptype = part.get("type")
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatFormatError(f"{where}.content[{j}].text must be a string")
            out.append(text)
        elif ptype in ("image_url", "image"):
            if not allow_images:
                raise ChatFormatError(f"{where}.content[{j}]: image parts are not supported here")
            out.append(("image",))
        else:
            raise ChatFormatError(f"{where}.content[{j}] has unknown part type {ptype!r}")
    return out


def content_items(msg: dict, where: str, required: bool, allow_images: bool) -> list:
    """Normalised content of a message: list of str / ("image",). Empty list if absent."""
    content = msg.get("content")
    if content is None:
        if required:
            raise ChatFormatError(f"{where} ({msg.get('role')}) needs 'content'")
        return []
    if isinstance(content, str):
        items = [content]
    elif isinstance(content, list):
        items = _text_of_parts(content, where, allow_images)
    else:
        raise ChatFormatError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
    if required and not any(isinstance(i, tuple) or i for i in items):
        raise ChatFormatError(f"{where} ({msg.get('role')}) has empty content")
    return items


def validate_tool_calls(msg: dict, where: str) -> list[dict]:
    """Normalised tool calls: [{"id": str|None, "name": str, "arguments": str|dict|list}]."""
    calls = msg.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}.tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(c, dict):
            raise ChatFormatError(f"{w} must be an object")
        fn = c.get("function", c)
        if not isinstance(fn, dict):
            raise ChatFormatError(f"{w}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatFormatError(f"{w}.function.name must be a non-empty string")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise ChatFormatError(f"{w}.function.arguments must be a JSON string or an object")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise ChatFormatError(f"{w}.id must be a string")
        out.append({"id": cid, "name": name, "arguments": args})
    return out


def validate_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where} must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where} has unknown role {role!r}; expected one of {ROLES}")
        rc = m.get("reasoning_content")
        if rc is not None and not isinstance(rc, str):
            raise ChatFormatError(f"{where}.reasoning_content must be a string")
        if role == "assistant":
            calls = validate_tool_calls(m, where)
            content_items(m, where, required=False, allow_images=False)
            if m.get("content") is None and not calls and rc is None:
                raise ChatFormatError(f"{where} (assistant) needs 'content' or 'tool_calls'")
        elif m.get("tool_calls") is not None:
            raise ChatFormatError(f"{where}: only assistant messages may carry tool_calls")
        if role == "tool":
            _check_tool_result(m, where)


def _check_tool_result(m: dict, where: str) -> None:
    """A tool message needs its content and a non-empty string `tool_call_id` (the id of the call
    it answers; K3's vendor verifier requires it, and Kimi-Linear's format names the result by it)."""
    if m.get("content") is None:
        raise ChatFormatError(f"{where} (tool) needs 'content'")
    cid = m.get("tool_call_id")
    if not isinstance(cid, str) or not cid:
        raise ChatFormatError(
            f"{where}.tool_call_id: a tool message needs the id of the call it answers (a non-empty string)",
            param=f"{where}.tool_call_id",
        )


def reject_images(messages) -> None:
    """`ChatFormatError` for the first image part of any message (the input is not validated
    otherwise here)."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        parts = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise ChatFormatError(
                    f"messages[{i}].content[{j}]: this server does not accept image "
                    f"input yet ({part['type']!r} part); send text only"
                )


def validate_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list")
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ChatFormatError(f"tools[{j}] must be an object")
        fn = t.get("function", t)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"tools[{j}] needs a function with a non-empty string name")
    return tools
