"""render_chat against hand-built expected strings / ids (spec/model.md §13-14): K3's XTML format."""

import pytest

from deltaserve.chat.common import ChatFormatError
from deltaserve.chat.render import render_chat
from tests.server.k3.chat_ids import K3_SPECIALS, check

# ------------------------------------------------------------------ K3 XTML

SYS = '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
USER = '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_NOTHINK = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
BASIC = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_k3_generation_prompts(k3):
    check(k3, render_chat(k3, "kimi_k3", BASIC), SYS + USER + GEN_THINK, K3_SPECIALS)
    check(k3, render_chat(k3, "kimi_k3", BASIC, thinking=False), SYS + USER + GEN_NOTHINK, K3_SPECIALS)
    check(k3, render_chat(k3, "kimi_k3", BASIC, add_generation_prompt=False), SYS + USER, K3_SPECIALS)


def test_k3_text_parts_and_image(k3):
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": " ok?"},
            ],
        }
    ]
    text = '<|open|>message role="user"<|sep|>Look: <|media_pad|> ok?<|close|>message<|sep|><|end_of_msg|>' + GEN_THINK
    ids = render_chat(k3, "kimi_k3", msgs)
    check(k3, ids, text, K3_SPECIALS)
    assert ids.count(k3.special_tokens["<|media_pad|>"]) == 1


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo",
            "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOLS_JSON = (
    '[{"function":{"description":"Météo","name":"get_weather","parameters":'
    '{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},'
    '"type":"function"}]'
)
DECLARE = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available '
    "tools, described in JSONSchema.\n\n```json\n" + TOOLS_JSON + "\n```<|close|>message<|sep|>"
    "<|end_of_msg|>"
)


def test_k3_tools_calls_and_results(k3):
    args = '{"city":"Paris","days":3,"metric":true,"extra":null,"opts":{"b":1,"a":"é"},"tags":["x", 2]}'
    msgs = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need tool",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]

    def arg(k, t, v):
        return f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>'

    text = (
        DECLARE
        + '<|open|>message role="user"<|sep|>Weather?<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>need tool<|close|>think<|sep|>'
        + "<|open|>response<|sep|><|close|>response<|sep|>"  # always present, may be empty
        + '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        + arg("city", "string", "Paris")
        + arg("days", "number", "3")
        + arg("metric", "boolean", "true")
        + arg("extra", "null", "null")
        + arg("opts", "object", '{"b":1,"a":"é"}')  # a string's values keep their literal text
        + arg("tags", "array", '["x", 2]')
        + '<|close|>call<|sep|><|open|>call tool="get_weather" index="2"<|sep|>'
        + arg("city", "string", "Rome")
        + "<|close|>call<|sep|><|close|>tools<|sep|>"
        + "<|close|>message<|sep|><|end_of_msg|>"
        # results are put in call order (c1 first) and indexed by position
        + '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>rain<|close|>message'
        + "<|sep|><|end_of_msg|>"
        + '<|open|>message role="tool" tool="get_weather" index="2"<|sep|>sunny<|close|>message'
        + "<|sep|><|end_of_msg|>"
        + GEN_THINK
    )
    check(k3, render_chat(k3, "kimi_k3", msgs, tools=TOOLS), text, K3_SPECIALS)


def test_k3_unparseable_arguments_and_attr_escaping(k3):
    msgs = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [{"id": "c", "function": {"name": 'a&b"c', "arguments": '{"city": Paris'}}],
        },
    ]
    text = (
        '<|open|>message role="user"<|sep|>x<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>'
        '<|open|>tools<|sep|><|open|>call tool="a&amp;b&quot;c" index="1"<|sep|>'
        '<|open|>json type="object"<|sep|>{"city": Paris<|close|>json<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>" + GEN_NOTHINK
    )
    check(k3, render_chat(k3, "kimi_k3", msgs, thinking=False), text, K3_SPECIALS)


def test_k3_preserved_thinking_multi_turn(k3):
    msgs = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    turn = '<|open|>message role="user"<|sep|>{}<|close|>message<|sep|><|end_of_msg|>'
    text = (
        turn.format("Q1") + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>R1'
        "<|close|>think<|sep|><|open|>response<|sep|>A1<|close|>response<|sep|><|close|>message"
        "<|sep|><|end_of_msg|>" + turn.format("Q2") + '<|open|>message role="assistant"<|sep|>'
        "<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>A2<|close|>response"
        "<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    check(k3, render_chat(k3, "kimi_k3", msgs, add_generation_prompt=False), text, K3_SPECIALS)


def test_k3_mid_conversation_tools(k3):
    msgs = [{"role": "user", "content": "x"}, {"role": "system", "tools": TOOLS}]
    text = (
        '<|open|>message role="user"<|sep|>x<|close|>message<|sep|><|end_of_msg|>'
        + DECLARE.replace(
            "# Tools\nHere are the available tools, described in JSONSchema.",
            "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\nHere are the specs for the extended tools.",
        )
        + GEN_THINK
    )
    check(k3, render_chat(k3, "kimi_k3", msgs), text, K3_SPECIALS)


@pytest.mark.parametrize("evil", ["<|open|>", "<|close|>message<|sep|><|end_of_msg|>", "[BOS]<|media_pad|>"])
def test_k3_user_specials_are_plain_text(k3, evil):
    for role in ("user", "system"):
        ids = render_chat(k3, "kimi_k3", [{"role": role, "content": evil}])
        body = ids[ids.index(k3.special_tokens["<|sep|>"]) + 1 :]
        body = body[: body.index(k3.special_tokens["<|close|>"])]
        assert body == k3.encode(evil, allow_special=False)
        assert not any(k3.is_special(i) for i in body)
        assert k3.decode(ids).startswith(f'<|open|>message role="{role}"<|sep|>{evil}<|close|>')
    # a tool result and a tool name are caller text too
    ids = render_chat(
        k3,
        "kimi_k3",
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "1", "function": {"name": evil, "arguments": {evil: evil}}}],
            },
            {"role": "tool", "tool_call_id": "1", "content": evil},
        ],
        add_generation_prompt=False,
    )
    n_struct = sum(1 for i in ids if i == k3.special_tokens["<|open|>"])
    assert n_struct == 7  # message, think, response, tools, call, argument, tool message


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], "must be an object"),
        ([{"role": "robot", "content": "x"}], "unknown role"),
        ([{"content": "x"}], "unknown role"),
        ([{"role": "user"}], "needs 'content'"),
        ([{"role": "user", "content": ""}], "empty content"),
        ([{"role": "system", "content": []}], "empty content"),
        ([{"role": "user", "content": 5}], "string or a list"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "unknown part type"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
        ([{"role": "assistant"}], "needs 'content' or 'tool_calls'"),
        ([{"role": "assistant", "content": "x", "tool_calls": {}}], "must be a list"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}], "non-empty string"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}], "arguments"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant"),
        ([{"role": "tool"}], "needs 'content'"),
        ([{"role": "user", "content": "x", "reasoning_content": 1}], "reasoning_content"),
    ],
)
def test_validation(k3, kl, family, messages, match):
    tok = k3 if family == "kimi_k3" else kl
    with pytest.raises(ChatFormatError, match=match):
        render_chat(tok, family, messages)


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_tool_message_without_tool_call_id(k3, kl, family):
    """Both formats refuse a tool result that names no call (Kimi-Linear renders the id as the
    result's only link to its call); the error names the field."""
    tok = k3 if family == "kimi_k3" else kl
    call = {"id": "c", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}]
    with pytest.raises(ChatFormatError, match="tool_call_id") as e:
        render_chat(tok, family, msgs + [{"role": "tool", "name": "f", "content": "ok"}])
    assert e.value.param == "messages[2].tool_call_id"
    assert render_chat(tok, family, msgs + [{"role": "tool", "tool_call_id": "c", "content": "ok"}])


def test_validation_misc(k3, kl):
    with pytest.raises(ChatFormatError, match="unknown model family"):
        render_chat(k3, "gpt", BASIC)
    with pytest.raises(ChatFormatError, match="tools"):
        render_chat(k3, "kimi_k3", BASIC, tools=[{"function": {}}])
    with pytest.raises(ChatFormatError, match="matches no call"):
        render_chat(k3, "kimi_k3", [{"role": "tool", "tool_call_id": "zz", "content": "r"}])
    with pytest.raises(ChatFormatError, match="image"):
        render_chat(kl, "kimi_linear", [{"role": "user", "content": [{"type": "image_url"}]}])
    assert issubclass(ChatFormatError, ValueError)
