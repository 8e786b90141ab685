"""Reasoning + tool-call parsing of generated text (spec/model.md §14; spec/serving.md §7 rows 7-9).

API:
- `parse_output(text, family, tools_declared, thinking=True) -> ParsedOutput(content,
  reasoning_content, tool_calls: list[ToolCall(id, name, arguments_json)])`.
- `StreamingParser(family, tools_declared, thinking=True)`: `.feed(delta_text) -> list[Delta]`,
  `.finish() -> list[Delta]`. `Delta(kind, text="", tool_call=None)` with kind "content",
  "reasoning" or "tool_call" (a tool call is emitted whole, once its element closes).

`parse_output` is `StreamingParser` fed the whole text, so streamed pieces concatenated equal the
non-streaming result for every split of the text (the parser is split-invariant: it holds back any
suffix that might still grow into a marker).

`text` is the decoded output with the control tokens kept as their names (`control_token_ids`:
the detokenizer keeps these and drops every other special, e.g. reserved ids). `thinking` says
whether the prompt ended inside a think element (K3's thinking generation prompt); with thinking
off it ended inside a response element. Rules:
- K3: `<|close|>think<|sep|>` ends reasoning; an opening `response` or `tools` marker (or
  `<|close|>message<|sep|>`) is an implicit think-close (serving §7 rows 7-8). With no close
  at all, everything is reasoning. `<|end_of_msg|>` is dropped.
- Tool markup with `tools_declared=False` is left verbatim in `content` and never becomes a
  tool call (row 9: the raw markup is surfaced rather than silently dropped).
- A malformed call (bad attributes, unknown argument type, bad JSON, unclosed at the end) is kept
  verbatim in `content`; well-formed calls of the same section still become tool calls.
- Kimi-Linear: `<think>`/`</think>` reasoning (a section marker is an implicit `</think>`),
  `<|tool_calls_section_begin|>` ... `<|tool_call_begin|>ID<|tool_call_argument_begin|>JSON
  <|tool_call_end|>` ... `<|tool_calls_section_end|>`; the function name is parsed from ids of the
  form `functions.NAME:IDX`, otherwise the whole id is the name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from deltaserve.server.parsers_lex import CONTROL_MARKERS, lex_k3, lex_kl

FAMILIES = ("kimi_k3", "kimi_linear")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Delta:
    kind: str  # "content" | "reasoning" | "tool_call"
    text: str = ""
    tool_call: ToolCall | None = None


def control_token_ids(tokenizer, family: str) -> frozenset[int]:
    """Ids of the special tokens the family's parser reads (think / response / tool markers):
    the `keep_special_token_ids` of a chat request, whose other specials are skipped."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    return frozenset(tokenizer.special_tokens[m] for m in CONTROL_MARKERS[family] if m in tokenizer.special_tokens)


# ---------------------------------------------------------------- argument decoding


def _k3_call(name_attrs: dict, body: list, n: int) -> ToolCall | None:
    """Build a ToolCall from a K3 call element's inner tokens, or None if malformed."""
    name = name_attrs.get("tool")
    if not name:
        return None
    args: dict = {}
    i, whole_json = 0, None
    while i < len(body):
        t = body[i]
        if t[0] == "text" and not t[1].strip():
            i += 1
            continue
        if t[0] != "tag" or t[1] != "open" or t[2] not in ("argument", "json"):
            return None
        if i + 2 < len(body) and body[i + 1][0] == "tag" and body[i + 1][1] == "close" and body[i + 1][2] == t[2]:
            value, i = "", i + 2
        elif (
            i + 2 < len(body)
            and body[i + 1][0] == "text"
            and body[i + 2][0] == "tag"
            and body[i + 2][1] == "close"
            and body[i + 2][2] == t[2]
        ):
            value, i = body[i + 1][1], i + 3
        else:
            return None
        if t[2] == "json":
            if args or whole_json is not None:
                return None
            whole_json = _json_object(value)
            if whole_json is None:
                return None
            continue
        if whole_json is not None or "key" not in t[3]:
            return None
        typ = t[3].get("type", "string")
        if typ == "string":
            args[t[3]["key"]] = value
            continue
        try:
            v = json.loads(value)
        except ValueError:
            return None
        ok = {
            "number": isinstance(v, (int, float)) and not isinstance(v, bool),
            "boolean": isinstance(v, bool),
            "null": v is None,
            "object": isinstance(v, dict),
            "array": isinstance(v, list),
        }.get(typ, False)
        if not ok:
            return None
        args[t[3]["key"]] = v
    final = whole_json if whole_json is not None else args
    index = name_attrs.get("index") or str(n)
    return ToolCall(f"functions.{name}:{index}", name, json.dumps(final, ensure_ascii=False))


def _json_object(text: str) -> dict | None:
    try:
        v = json.loads(text)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def _kl_call(call_id: str, args: str) -> ToolCall | None:
    call_id = call_id.strip()
    if not call_id:
        return None
    v = _json_object(args)
    if v is None:
        return None
    m = re.fullmatch(r"functions\.(.+):(\d+)", call_id)
    name = m.group(1) if m else call_id
    return ToolCall(call_id, name, json.dumps(v, ensure_ascii=False))


# ---------------------------------------------------------------- streaming parser


class StreamingParser:
    """Incremental parser; see the module docstring. Not thread-safe."""

    def __init__(self, family: str, tools_declared: bool, thinking: bool = True):
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
        self.family, self.tools_declared = family, bool(tools_declared)
        if family == "kimi_k3":
            self.state = "think" if thinking else "response"
        else:
            self.state = "response"
        self._buf = ""
        self._call: list | None = None  # tokens of the call being collected (K3) / raw (KL)
        self._n_calls = 0
        self._done = False

    # -- public
    def feed(self, delta_text: str) -> list[Delta]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        if not isinstance(delta_text, str):
            raise TypeError("delta_text must be str")
        self._buf += delta_text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        if self._done:
            return []
        out = self._run(final=True)
        if self._call is not None:  # unclosed call: verbatim content
            out += self._emit("content", "".join(t[-1] for t in self._call))
            self._call = None
        self._done = True
        return _merge(out)

    # -- internals
    def _run(self, final: bool) -> list[Delta]:
        lex = lex_k3 if self.family == "kimi_k3" else lex_kl
        toks, self._buf = lex(self._buf, final)
        out: list[Delta] = []
        for t in toks:
            out += self._k3(t) if self.family == "kimi_k3" else self._kl(t)
        return _merge(out)

    @staticmethod
    def _emit(kind: str, text: str) -> list[Delta]:
        return [Delta(kind, text)] if text else []

    def _text_kind(self) -> str:
        return "reasoning" if self.state == "think" else "content"

    def _k3(self, t) -> list[Delta]:
        raw = t[-1]
        if self._call is not None:
            if t[0] == "tag" and t[1] == "close" and t[2] == "call":
                head, body = self._call[0], _join_text(self._call[1:])
                self._call = None
                self._n_calls += 1
                call = _k3_call(head[3], body, self._n_calls)
                if call is None:
                    return self._emit("content", head[-1] + "".join(x[-1] for x in body) + raw)
                return [Delta("tool_call", tool_call=call)]
            if t[0] == "tag" and (
                t[1] == "close"
                and t[2] in ("tools", "message")
                or t[2] == "end_of_msg"
                or t[1] == "open"
                and t[2] == "call"
            ):
                pending = "".join(x[-1] for x in self._call)
                self._call = None
                return self._emit("content", pending) + self._k3(t)
            self._call.append(t)
            return []
        if t[0] == "text":
            return self._emit(self._text_kind(), raw)
        kind, name = t[1], t[2]
        st = self.state
        if name == "end_of_msg":
            return []
        if kind == "close" and name == "message" and st != "tools":
            self.state = "done"
            return []
        if self.tools_declared and st == "tools":
            if kind == "open" and name == "call":
                self._call = [t]
                return []
            if kind == "close" and name in ("tools", "message"):
                self.state = "after" if name == "tools" else "done"
                return []
            return self._emit("content", raw)
        if kind == "open" and name == "response" and st in ("think", "after"):
            self.state = "response"
            return []
        if kind == "open" and name == "think" and st in ("after", "response"):
            self.state = "think"
            return []
        if kind == "close" and name == st and st in ("think", "response"):
            self.state = "after"
            return []
        if kind == "open" and name == "tools" and self.tools_declared and st in ("think", "response", "after"):
            self.state = "tools"
            return []
        if kind == "close" and name == "message":  # st == "tools" without declared tools: n/a
            self.state = "done"
            return []
        if kind == "open" and name == "tools" and st == "think":
            # undeclared tools still end reasoning (implicit think-close); markup stays content
            self.state = "after"
            return self._emit("content", raw)
        return self._emit(self._text_kind(), raw)

    def _kl(self, t) -> list[Delta]:
        raw = t[-1]
        if self._call is not None:
            if t[0] == "tag" and t[2] == "<|tool_call_end|>":
                head, parts = self._call[0], self._call[1:]
                self._call = None
                text = "".join(x[-1] for x in parts)
                a = text.find("<|tool_call_argument_begin|>")
                call = (
                    _kl_call(text[:a], text[a + len("<|tool_call_argument_begin|>") :])
                    if a >= 0 and text.count("<|tool_call_argument_begin|>") == 1
                    else None
                )
                if call is None:
                    return self._emit("content", head[-1] + text + raw)
                return [Delta("tool_call", tool_call=call)]
            if t[0] == "tag" and t[2] in ("<|tool_calls_section_end|>", "<|im_end|>", "<|tool_call_begin|>"):
                pending = "".join(x[-1] for x in self._call)
                self._call = None
                return self._emit("content", pending) + self._kl(t)
            self._call.append(t)
            return []
        if t[0] == "text":
            return self._emit(self._text_kind(), raw)
        name, st = t[2], self.state
        if name == "<|im_end|>":
            self.state = "done"
            return []
        if name == "<think>" and st == "response":
            self.state = "think"
            return []
        if name == "</think>" and st == "think":
            self.state = "response"
            return []
        if self.tools_declared:
            if name == "<|tool_calls_section_begin|>" and st in ("think", "response"):
                self.state = "tools"
                return []
            if st == "tools":
                if name == "<|tool_call_begin|>":
                    self._call = [t]
                    return []
                if name == "<|tool_calls_section_end|>":
                    self.state = "response"
                    return []
        elif name == "<|tool_calls_section_begin|>" and st == "think":
            self.state = "response"
        return self._emit(self._text_kind(), raw)


def _join_text(toks: list) -> list:
    out: list = []
    for t in toks:
        if t[0] == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + t[1])
        else:
            out.append(t)
    return out


def _merge(deltas: list[Delta]) -> list[Delta]:
    out: list[Delta] = []
    for d in deltas:
        if out and d.kind != "tool_call" and out[-1].kind == d.kind:
            out[-1] = Delta(d.kind, out[-1].text + d.text)
        else:
            out.append(d)
    return out


def collect(deltas: list[Delta]) -> ParsedOutput:
    """Assemble streamed deltas into a ParsedOutput."""
    res = ParsedOutput()
    parts = {"content": [], "reasoning": []}
    for d in deltas:
        if d.kind == "tool_call":
            res.tool_calls.append(d.tool_call)
        else:
            parts[d.kind].append(d.text)
    res.content, res.reasoning_content = "".join(parts["content"]), "".join(parts["reasoning"])
    return res


def parse_output(text: str, family: str, tools_declared: bool, thinking: bool = True) -> ParsedOutput:
    """Non-streaming parse; identical to concatenating a StreamingParser's deltas."""
    p = StreamingParser(family, tools_declared, thinking)
    return collect(p.feed(text) + p.finish())
