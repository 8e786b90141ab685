"""Reasoning / tool-call parsing (spec/model.md §14; spec/serving.md §7 rows 7-9)."""

import json
import random

import pytest

from deltaserve.chat.render import render_chat
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.server.parsers import Delta, ParsedOutput, StreamingParser, ToolCall, collect, parse_output
from deltaserve.tiny import make_tiny

TC = "<|close|>think<|sep|>"
R_OPEN, R_CLOSE = "<|open|>response<|sep|>", "<|close|>response<|sep|>"
T_OPEN, T_CLOSE = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
END = "<|close|>message<|sep|><|end_of_msg|>"


def call(name, idx, *args):
    body = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
    return f'<|open|>call tool="{name}" index="{idx}"<|sep|>{body}<|close|>call<|sep|>'


PARIS = call("get_weather", 1, ("city", "string", "Paris"), ("days", "number", "3"))
PARIS_TC = ToolCall("functions.get_weather:1", "get_weather", '{"city": "Paris", "days": 3}')


def test_k3_think_then_response():
    r = parse_output("Let me think." + TC + R_OPEN + "Hello!" + R_CLOSE + END, "kimi_k3", False)
    assert r == ParsedOutput("Hello!", "Let me think.", [])


def test_k3_thinking_off_starts_in_response():
    r = parse_output("Hello!" + R_CLOSE + END, "kimi_k3", True, thinking=False)
    assert r == ParsedOutput("Hello!", "", [])


def test_k3_missing_think_close_before_response():  # serving §7 row 7/8
    r = parse_output("reasoning" + R_OPEN + "answer" + R_CLOSE + END, "kimi_k3", True)
    assert r == ParsedOutput("answer", "reasoning", [])


def test_k3_missing_think_close_before_tools():  # serving §7 row 7
    r = parse_output("need a tool" + T_OPEN + PARIS + T_CLOSE + END, "kimi_k3", True)
    assert r == ParsedOutput("", "need a tool", [PARIS_TC])


def test_k3_no_close_at_all_is_reasoning():
    assert parse_output("still thinking", "kimi_k3", True) == ParsedOutput("", "still thinking", [])


def test_k3_full_tool_turn():
    c2 = call(
        "lookup",
        2,
        ("on", "boolean", "true"),
        ("x", "null", "null"),
        ("o", "object", '{"a": [1, "é"]}'),
        ("l", "array", "[1, 2]"),
    )
    text = "r" + TC + R_OPEN + "checking" + R_CLOSE + T_OPEN + PARIS + c2 + T_CLOSE + END
    r = parse_output(text, "kimi_k3", True)
    assert r.content == "checking" and r.reasoning_content == "r"
    assert r.tool_calls == [
        PARIS_TC,
        ToolCall("functions.lookup:2", "lookup", '{"on": true, "x": null, "o": {"a": [1, "é"]}, "l": [1, 2]}'),
    ]


def test_k3_json_element_and_attr_unescape():
    c = (
        '<|open|>call tool="a&amp;b&quot;" index="1"<|sep|><|open|>json type="object"<|sep|>'
        '{"k": 1}<|close|>json<|sep|><|close|>call<|sep|>'
    )
    r = parse_output(TC + T_OPEN + c + T_CLOSE, "kimi_k3", True)
    assert r.tool_calls == [ToolCall('functions.a&b":1', 'a&b"', '{"k": 1}')]


def test_k3_tools_not_declared_stay_content():  # serving §7 row 9
    markup = T_OPEN + PARIS + T_CLOSE
    r = parse_output("r" + TC + R_OPEN + "hi" + R_CLOSE + markup + END, "kimi_k3", False)
    assert r == ParsedOutput("hi" + markup, "r", [])
    r = parse_output("r" + markup, "kimi_k3", False)  # still an implicit think-close
    assert r == ParsedOutput(markup, "r", [])


@pytest.mark.parametrize(
    "bad",
    [
        call("f", 1, ("n", "number", "abc")),  # bad JSON
        call("f", 1, ("n", "number", '"3"')),  # wrong type
        call("f", 1, ("n", "weird", "1")),  # unknown type
        '<|open|>call index="1"<|sep|><|close|>call<|sep|>',  # no tool name
        '<|open|>call tool="f" index="1"<|sep|>junk<|close|>call<|sep|>',
        '<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>{oops'
        "<|close|>json<|sep|><|close|>call<|sep|>",
    ],
)
def test_k3_malformed_call_is_content(bad):
    r = parse_output(TC + T_OPEN + PARIS + bad + T_CLOSE + END, "kimi_k3", True)
    assert r == ParsedOutput(bad, "", [PARIS_TC])


def test_k3_unclosed_call_at_end_is_content():
    partial = '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>x'
    r = parse_output(TC + T_OPEN + partial, "kimi_k3", True)
    assert r == ParsedOutput(partial, "", [])
    r = parse_output(TC + T_OPEN + partial + END, "kimi_k3", True)
    assert r == ParsedOutput(partial, "", [])


def test_k3_stray_markers_are_text():
    text = "a <|open|> b <|close|>x y<|sep|>" + TC + R_OPEN + "<|open|>unknown<|sep|>z<|open|>"
    r = parse_output(text, "kimi_k3", False)
    assert r == ParsedOutput("<|open|>unknown<|sep|>z<|open|>", "a <|open|> b <|close|>x y<|sep|>", [])


# ------------------------------------------------------------------ Kimi-Linear

KL_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


def test_kl_content_and_tool_call():
    r = parse_output("Sure." + KL_CALL + "<|im_end|>", "kimi_linear", True)
    assert r == ParsedOutput("Sure.", "", [ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')])


def test_kl_think_and_implicit_close():
    assert parse_output("<think>hmm</think>ok", "kimi_linear", False) == ParsedOutput("ok", "hmm", [])
    r = parse_output("<think>hmm" + KL_CALL, "kimi_linear", True)
    assert r.reasoning_content == "hmm" and len(r.tool_calls) == 1 and r.content == ""


def test_kl_undeclared_and_malformed():
    assert parse_output(KL_CALL, "kimi_linear", False) == ParsedOutput(KL_CALL, "", [])
    bad = "<|tool_call_begin|>f<|tool_call_argument_begin|>{nope<|tool_call_end|>"
    text = "<|tool_calls_section_begin|>" + bad + "<|tool_calls_section_end|>"
    assert parse_output(text, "kimi_linear", True) == ParsedOutput(bad, "", [])


# ------------------------------------------------------------------ streaming == non-streaming

CORPUS = [
    ("kimi_k3", "Let me think." + TC + R_OPEN + "Hello!" + R_CLOSE + END),
    ("kimi_k3", "reasoning" + R_OPEN + "answer <|clo" + R_CLOSE + END),
    ("kimi_k3", "need" + T_OPEN + PARIS + call("f", 2, ("n", "number", "x")) + T_CLOSE + END),
    ("kimi_k3", "r" + TC + R_OPEN + "hi" + R_CLOSE + T_OPEN + PARIS + T_CLOSE + END),
    ("kimi_k3", "a <|open|> b <|close|>x y<|sep|><|op" + TC + "<|open|>tools<|se"),
    ("kimi_k3", TC + T_OPEN + '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a"'),
    ("kimi_k3", "x" * 700 + "<|open|>" + "y" * 600 + "<|sep|>" + TC + "é中文" + R_OPEN),
    ("kimi_linear", "<think>hmm</think>Sure." + KL_CALL + "<|im_end|>"),
    (
        "kimi_linear",
        "<think>h<|tool_calls_section_begin|><|tool_call_begin|>x<|tool_call_end|>"
        "<|tool_call_begin|>functions.a:1<|tool_call_argument_begin|>{}<|tool_call_end|>",
    ),
    ("kimi_linear", "plain <thin <|im_e"),
]


def _stream(family, text, tools, thinking, cuts):
    p = StreamingParser(family, tools, thinking)
    out, prev = [], 0
    for c in list(cuts) + [len(text)]:
        out += p.feed(text[prev:c])
        prev = c
    return out + p.finish()


@pytest.mark.parametrize("family,text", CORPUS)
@pytest.mark.parametrize("tools", [True, False])
@pytest.mark.parametrize("thinking", [True, False])
def test_streaming_matches_non_streaming(family, text, tools, thinking):
    want = parse_output(text, family, tools, thinking)
    rng = random.Random(hash((text, tools, thinking)) & 0xFFFF)
    assert collect(_stream(family, text, tools, thinking, range(1, len(text)))) == want  # 1 char
    for _ in range(60):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, min(8, len(text)))))
        deltas = _stream(family, text, tools, thinking, cuts)
        assert all(isinstance(d, Delta) and (d.text or d.tool_call) for d in deltas)
        assert collect(deltas) == want


def test_streaming_emits_early_and_holds_partial_markers():
    p = StreamingParser("kimi_k3", True)
    assert p.feed("abc<|clo") == [Delta("reasoning", "abc")]
    assert p.feed("se|>think<|sep|>") == []
    assert p.feed(R_OPEN + "hel") == [Delta("content", "hel")]
    assert p.feed("lo" + R_CLOSE + T_OPEN + PARIS[:20]) == [Delta("content", "lo")]
    assert p.feed(PARIS[20:]) == [Delta("tool_call", tool_call=PARIS_TC)]
    assert p.finish() == []
    with pytest.raises(RuntimeError):
        p.feed("x")


def test_unknown_family():
    with pytest.raises(ValueError):
        StreamingParser("gpt", True)


# ------------------------------------------------------------------ render -> parse round trip


def test_k3_render_parse_round_trip(tmp_path):
    tok = Tokenizer.from_pretrained(make_tiny(tmp_path, family="kimi_k3"))
    args = {"city": "Paris <|open|>", "n": 2.5, "ok": False, "l": [1, {"z": None}]}
    msgs = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "answer",
            "reasoning_content": "why",
            "tool_calls": [{"id": "1", "function": {"name": "get", "arguments": json.dumps(args)}}],
        },
    ]
    prompt = tok.decode(render_chat(tok, "kimi_k3", msgs[:1]))
    full = tok.decode(render_chat(tok, "kimi_k3", msgs, add_generation_prompt=False))
    assert full.startswith(prompt)
    r = parse_output(full[len(prompt) :], "kimi_k3", True)
    assert (r.content, r.reasoning_content) == ("answer", "why")
    assert [(c.name, json.loads(c.arguments_json)) for c in r.tool_calls] == [("get", args)]
