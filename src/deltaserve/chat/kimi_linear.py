"""Kimi-Linear (Kimi-K2 `<|im_*|>`) renderer (spec/model.md §14.2).

With a `chat_template.jinja` (the checkpoint's, used verbatim) the template is rendered with
`jinja2.sandbox.ImmutableSandboxedEnvironment`. To keep "control tokens only from the renderer",
every caller-supplied string (content, text parts, tool-call ids / names / arguments, tool_call_id,
every string value in `tools`) is wrapped in private-use sentinels before rendering; in the
output, sentinel spans are plain text (specials disallowed) and only the template's own text may
produce special ids. Empty strings are not wrapped (templates test their truthiness).

Without a template the same format as the tiny checkpoint's template is
written in code (`_code_pieces`).
"""

from __future__ import annotations

import json
import re

from .common import ChatFormatError, Special, content_items, encode_pieces, validate_tool_calls

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
_SENTINEL_CANDIDATES = [("\ue000", "\ue001"), ("\ue002", "\ue003"), ("\uf8fe", "\uf8ff"), ("\U000f0000", "\U000f0001")]


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _code_pieces(messages: list[dict], tools: list[dict], add_generation_prompt: bool) -> list:
    S = Special
    out: list = []
    if tools:
        out += [S("<|im_system|>"), "tool_declare", S("<|im_middle|>"), _json(tools), S("<|im_end|>")]
    for i, m in enumerate(messages):
        role, where = m["role"], f"messages[{i}]"
        if i == 0 and role != "system":
            out += [S("<|im_system|>"), "system", S("<|im_middle|>"), DEFAULT_SYSTEM, S("<|im_end|>")]
        head = {
            "system": ("<|im_system|>", "system"),
            "user": ("<|im_user|>", "user"),
            "assistant": ("<|im_assistant|>", "assistant"),
            "tool": ("<|im_system|>", "tool"),
        }[role]
        out += [S(head[0]), head[1], S("<|im_middle|>")]
        if role == "tool":
            out.append(f"## Return of {m.get('tool_call_id') or ''}\n")
        out += content_items(m, where, required=False, allow_images=False)
        calls = validate_tool_calls(m, where) if role == "assistant" else []
        if calls:
            out.append(S("<|tool_calls_section_begin|>"))
            for j, c in enumerate(calls):
                cid = c["id"] or f"functions.{c['name']}:{j}"
                args = (
                    c["arguments"]
                    if isinstance(c["arguments"], str)
                    else json.dumps(c["arguments"], ensure_ascii=False)
                )
                out += [S("<|tool_call_begin|>"), cid, S("<|tool_call_argument_begin|>"), args, S("<|tool_call_end|>")]
            out.append(S("<|tool_calls_section_end|>"))
        out.append(S("<|im_end|>"))
    if add_generation_prompt:
        out += [S("<|im_assistant|>"), "assistant", S("<|im_middle|>")]
    return out


def _check_required(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        required = m["role"] in ("system", "user")
        content_items(m, f"messages[{i}]", required=required, allow_images=False)
        if m["role"] == "tool" and m.get("content") is None:
            raise ChatFormatError(f"messages[{i}] (tool) needs 'content'")


def _wrap(obj, lo: str, hi: str, keys: tuple | None = None):
    """Wrap non-empty strings: all of them if `keys` is None, else only the string values (and
    everything inside the values) of dict keys in `keys`; other values are recursed into."""
    if isinstance(obj, str):
        return f"{lo}{obj}{hi}" if obj and keys is None else obj
    if isinstance(obj, list):
        return [_wrap(v, lo, hi, keys) for v in obj]
    if isinstance(obj, dict):
        return {
            k: _wrap(
                v,
                lo,
                hi,
                None if keys is None or (k in keys and not (k == "content" and isinstance(v, list))) else keys,
            )
            for k, v in obj.items()
        }
    return obj


def _dict_keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _dict_keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _dict_keys(v)


_USER_KEYS = ("content", "text", "tool_call_id", "reasoning_content", "name", "arguments", "id")


def _template_ids(tokenizer, template: str, messages, tools, add_generation_prompt) -> list[int]:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    blob = json.dumps([messages, tools], ensure_ascii=False)
    lo, hi = next(((a, b) for a, b in _SENTINEL_CANDIDATES if a not in blob and b not in blob), (None, None))
    if lo is None:
        raise ChatFormatError("messages contain every private-use sentinel character; cannot render")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' chat-template tojson (no HTML escaping)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    bad = [
        k
        for k in _dict_keys([messages, tools])
        if isinstance(k, str) and "<|" in k and any(sp in k for sp in tokenizer.special_tokens)
    ]
    if bad:
        raise ChatFormatError(f"object key {bad[0]!r} contains a special-token string")
    wmsgs = [_wrap(m, lo, hi, _USER_KEYS) for m in messages]
    wtools = _wrap(tools, lo, hi) if tools else None
    try:
        text = env.from_string(template).render(
            messages=wmsgs, tools=wtools, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as e:
        raise ChatFormatError(f"chat template failed: {e}") from e
    specials = sorted(tokenizer.special_tokens, key=len, reverse=True)
    special_re = re.compile("|".join(re.escape(s) for s in specials))
    pieces: list = []
    pos = 0
    for m in re.finditer(re.escape(lo) + "(.*?)" + re.escape(hi), text, flags=re.S):
        _split_specials(text[pos : m.start()], special_re, pieces)
        pieces.append(m.group(1))
        pos = m.end()
    _split_specials(text[pos:], special_re, pieces)
    if any(isinstance(p, str) and (lo in p or hi in p) for p in pieces):
        raise ChatFormatError("chat template split a caller string; cannot keep specials out of it")
    return encode_pieces(tokenizer, pieces)


def _split_specials(text: str, special_re, pieces: list) -> None:
    pos = 0
    for m in special_re.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos : m.start()])
        pieces.append(Special(m.group(0)))
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])


def kimi_linear_ids(tokenizer, messages, tools, add_generation_prompt, chat_template) -> list[int]:
    _check_required(messages)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            validate_tool_calls(m, f"messages[{i}]")
    if chat_template is not None:
        return _template_ids(tokenizer, chat_template, messages, tools, add_generation_prompt)
    return encode_pieces(tokenizer, _code_pieces(messages, tools, add_generation_prompt))
