"""Marker lexers for `parsers.py` (K3 XTML tags, Kimi-Linear marker strings).

A token is ("text", raw) or ("tag", kind, name, attrs, raw) with kind "open"/"close"/"mark".
Each lexer returns (tokens, rest): `rest` is a suffix that might still grow into a marker and must
wait for more text (nothing is held when `final`). Decisions depend only on the whole text, never
on how it was split, so streaming and non-streaming parses agree.
"""

from __future__ import annotations

import html
import re

MAX_TAG = 512  # an open/close tag whose <|sep|> is not found within this many chars is text

K3_STARTS = ("<|open|>", "<|close|>", "<|end_of_msg|>")
KL_MARKS = (
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_end|>",
)
CONTROL_MARKERS = {"kimi_k3": (*K3_STARTS, "<|sep|>"), "kimi_linear": KL_MARKS}  # what the lexers read
_ATTR = re.compile(r'\s+([A-Za-z_][\w-]*)="([^"]*)"')
_HEAD = re.compile(r"([A-Za-z_][\w-]*)((?:\s+[A-Za-z_][\w-]*=\"[^\"]*\")*)\s*")


def _held_suffix(buf: str, starts) -> int:
    """Length of the longest suffix of buf that is a proper prefix of some marker."""
    best = 0
    for s in starts:
        for n in range(min(len(s) - 1, len(buf)), best, -1):
            if buf.endswith(s[:n]):
                best = n
                break
    return best


def _parse_head(head: str):
    m = _HEAD.fullmatch(head)
    if not m:
        return None
    return m.group(1), {k: html.unescape(v) for k, v in _ATTR.findall(m.group(2))}


def lex_k3(buf: str, final: bool):
    """Yield tokens from buf; return (tokens, rest) where rest must wait for more text."""
    toks, pos = [], 0
    while True:
        idx = [(buf.find(s, pos), s) for s in K3_STARTS]
        idx = [(i, s) for i, s in idx if i >= 0]
        if not idx:
            break
        i, s = min(idx)
        if i > pos:
            toks.append(("text", buf[pos:i]))
        if s == "<|end_of_msg|>":
            toks.append(("tag", "mark", "end_of_msg", {}, s))
            pos = i + len(s)
            continue
        j = i + len(s)
        window = buf[j : j + MAX_TAG + len("<|sep|>")]
        sep, nxt = window.find("<|sep|>"), window.find("<|")
        if sep < 0 or nxt < sep:
            # wait only while the tag could still close within MAX_TAG characters
            if (
                sep < 0
                and not final
                and len(window) < MAX_TAG + len("<|sep|>")
                and (nxt < 0 or "<|sep|>".startswith(window[nxt:]))
            ):
                return toks, buf[i:]
            toks.append(("text", s))  # not a tag: the marker is text
            pos = j
            continue
        sep += j
        head = _parse_head(buf[j:sep])
        raw = buf[i : sep + len("<|sep|>")]
        if head is None or (s == "<|close|>" and head[1]):
            toks.append(("text", raw))
        else:
            toks.append(("tag", "open" if s == "<|open|>" else "close", head[0], head[1], raw))
        pos = sep + len("<|sep|>")
    rest = buf[pos:]
    keep = 0 if final else _held_suffix(rest, K3_STARTS)
    if len(rest) > keep:
        toks.append(("text", rest[: len(rest) - keep]))
    return toks, rest[len(rest) - keep :] if keep else ""


def lex_kl(buf: str, final: bool):
    toks, pos = [], 0
    pat = re.compile("|".join(re.escape(m) for m in KL_MARKS))
    for m in pat.finditer(buf):
        if m.start() > pos:
            toks.append(("text", buf[pos : m.start()]))
        toks.append(("tag", "mark", m.group(0), {}, m.group(0)))
        pos = m.end()
    rest = buf[pos:]
    keep = 0 if final else _held_suffix(rest, KL_MARKS)
    if len(rest) > keep:
        toks.append(("text", rest[: len(rest) - keep]))
    return toks, rest[len(rest) - keep :] if keep else ""
