"""Chat rendering: OpenAI-style messages -> prompt token ids (spec/model.md §13-14).

Public API: `render_chat(tokenizer, family, messages, tools=None, add_generation_prompt=True,
thinking=True, chat_template=None, controls=(), accept_images=True) -> list[int]`,
`ChatFormatError`, `load_chat_template(dir)`. With `accept_images=False` (the server, until
vision is served) any image part (`IMAGE_PART_TYPES`) is refused rather than rendered as a pad.

Invariant: control (special) tokens come only from the renderer. Every renderer produces a
sequence of `Special(name)` and plain-text pieces; adjacent plain-text pieces are joined and
encoded with specials *disallowed*, so a user typing `<|open|>` gets ordinary BPE ids. Joining
first means the ids equal those of "render the string, tokenize it allowing specials only where
the renderer put them" (no extra BPE boundaries at attribute / body seams).

K3 "XTML" lives in `chat_k3.py`; Kimi-Linear `<|im_*|>` in `chat_kimi_linear.py` (the checkpoint's
`chat_template.jinja` rendered in a sandbox when given, else the same format in code).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("kimi_k3", "kimi_linear")
ROLES = ("system", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_file")


class ChatFormatError(ValueError):
    """The request's messages / tools cannot be rendered (bad role, content or types)."""


@dataclass(frozen=True)
class Special:
    """A control token, resolved by name against the tokenizer at encode time."""
    name: str


def encode_pieces(tokenizer, pieces) -> list[int]:
    """Encode a sequence of `Special` / `str` pieces (see module docstring)."""
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
                raise ChatFormatError(f"the tokenizer has no special token {p.name!r}, which this "
                                      "chat format needs")
            ids.append(tid)
        else:
            buf.append(p)
    flush()
    return ids


# ---------------------------------------------------------------- validation (shared)

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
        raise ChatFormatError(f"{where}.content must be a string or a list of parts, got "
                              f"{type(content).__name__}")
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


def reject_images(messages) -> None:
    """`ChatFormatError` for the first image part of any message (the input is not validated
    otherwise here)."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        parts = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise ChatFormatError(f"messages[{i}].content[{j}]: this server does not accept image "
                                      f"input yet ({part['type']!r} part); send text only")


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


# ---------------------------------------------------------------- entry point

def load_chat_template(model_dir) -> str | None:
    """The checkpoint's `chat_template.jinja` text, or None if it ships none."""
    p = Path(model_dir) / "chat_template.jinja"
    return p.read_text(encoding="utf-8") if p.is_file() else None


def render_chat(tokenizer, family: str, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, thinking: bool = True,
                chat_template: str | None = None, controls=(), accept_images: bool = True) -> list[int]:
    """Prompt token ids for `messages` (+ `tools`) in `family`'s chat format.

    `thinking` selects K3's thinking (`<|open|>think<|sep|>`) or non-thinking
    (`<|open|>response<|sep|>`) generation prompt; Kimi-Linear (an instruct model) ignores it.
    `chat_template` (Kimi-Linear only) is a jinja template, e.g. from `load_chat_template`.
    `controls` (K3 only; Kimi-Linear has no such messages) are `(type, body)` control messages.
    `accept_images=False` refuses image parts. Raises `ChatFormatError` for malformed input.
    """
    if family not in FAMILIES:
        raise ChatFormatError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    if not accept_images:
        reject_images(messages)
    validate_messages(messages)
    tools = validate_tools(tools)
    if not isinstance(thinking, bool) or not isinstance(add_generation_prompt, bool):
        raise ChatFormatError("thinking and add_generation_prompt must be booleans")
    if family == "kimi_k3":
        from deltaserve.server.chat_k3 import k3_pieces
        image = "<|kimi_image_placeholder|>" if "<|kimi_image_placeholder|>" in \
            tokenizer.special_tokens else "<|media_pad|>"
        return encode_pieces(tokenizer, k3_pieces(messages, tools, add_generation_prompt, thinking,
                                                  Special(image), controls))
    from deltaserve.server.chat_kimi_linear import kimi_linear_ids
    return kimi_linear_ids(tokenizer, messages, tools, add_generation_prompt, chat_template)
