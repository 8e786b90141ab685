"""K3 control messages (spec/model.md §14.1) rendered exactly, and the server's mapping of
response_format / tool_choice / effort to constraints and controls (server/constraints.py)."""

import json

import pytest

from deltaserve.chat.common import ChatFormatError
from deltaserve.chat.render import render_chat
from deltaserve.engine.request.structured import StructuredOutput
from deltaserve.server.constraints import K3_THINK_END, chat_constraint, forced_tool_calls
from deltaserve.server.errors import APIError
from deltaserve.server.protocol import ChatRequest
from tests.server.k3.chat_ids import K3_SPECIALS, check

USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
TOOLS_TEXT = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available '
    "tools, described in JSONSchema.\n\n```json\n"
    '[{"function":{"name":"f","parameters":{"type":"object"}},"type":"function"}]'
    "\n```<|close|>message<|sep|><|end_of_msg|>"
)
USER_TEXT = '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_NOTHINK = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def control(kind, body):
    return f'<|open|>message role="system" type="{kind}"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'


def req(**kw):
    return ChatRequest(model="m", messages=USER, **kw)


EFFORT_MAX = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
    "with `thinking_effort=max`."
)
REQUIRED = "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
NONE = "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
JSON_OBJECT = (
    "The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data "
    "without markdown code blocks (```json) or any additional formatting."
)


def test_k3_control_messages_render_exactly(k3):
    """The reference bodies and places: effort after the tool declaration, before the
    conversation; tool choice and format after it."""
    controls = (("thinking_effort", "max"), ("tool_choice", "required"), ("response_format", "json_object"))
    ids = render_chat(k3, "kimi_k3", USER, tools=TOOLS, controls=controls)
    text = (
        TOOLS_TEXT
        + control("thinking-effort", EFFORT_MAX)
        + USER_TEXT
        + control("tool-choice", REQUIRED)
        + control("response-format", JSON_OBJECT)
        + GEN_THINK
    )
    check(k3, ids, text, K3_SPECIALS)
    ids = render_chat(
        k3, "kimi_k3", USER, thinking=False, controls=(("tool_choice", "none"), ("thinking_effort", "max"))
    )
    check(k3, ids, USER_TEXT + control("tool-choice", NONE) + GEN_NOTHINK, K3_SPECIALS)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ids = render_chat(k3, "kimi_k3", USER, thinking=False, controls=(("response_format", schema),))
    body = (
        JSON_OBJECT.replace("json_object", "json_schema")
        + '\nThe JSON data must match the following schema:\n```json\n{"properties":{"a":{"type":"integer"}},'
        '"type":"object"}\n```'
    )
    check(k3, ids, USER_TEXT + control("response-format", body) + GEN_NOTHINK, K3_SPECIALS)
    for bad in [("effort", "x"), ("tool_choice", ""), ("thinking_effort", "medium"), ("tool_choice",), "tool_choice"]:
        with pytest.raises(ChatFormatError, match="control message"):
            render_chat(k3, "kimi_k3", USER, controls=(bad,))


def test_controls_from_request():
    assert chat_constraint(req(reasoning_effort="high"), "kimi_k3", True).controls == (("thinking_effort", "high"),)
    assert chat_constraint(req(thinking_effort="max", reasoning_effort="low"), "kimi_k3", True).controls == (
        ("thinking_effort", "max"),
    )
    assert chat_constraint(req(reasoning_effort="high"), "kimi_k3", False).controls == ()
    assert chat_constraint(req(tools=TOOLS, tool_choice="none"), "kimi_k3", True).controls == (("tool_choice", "none"),)
    assert chat_constraint(req(tools=TOOLS, tool_choice="auto"), "kimi_k3", True).controls == ()
    named = {"type": "function", "function": {"name": "f"}}
    c = chat_constraint(req(tools=TOOLS, tool_choice=named), "kimi_k3", True)
    assert c.controls == (("tool_choice", "required"),) and c.tool == "f"
    assert c.structured == StructuredOutput.json({"type": "object"}, K3_THINK_END)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    c = chat_constraint(req(response_format=rf), "kimi_k3", False)
    assert c.controls == (("response_format", schema),) and c.tool is None
    assert c.structured == StructuredOutput.json(schema)
    kl = chat_constraint(req(response_format={"type": "json_object"}), "kimi_linear", True)
    assert kl.structured == StructuredOutput.json() and kl.controls == (("response_format", "json_object"),)
    assert chat_constraint(req(), "kimi_k3", True) == chat_constraint(req(), "kimi_k3", True)
    assert chat_constraint(req(), "kimi_k3", True).structured is None


def test_required_schema_respects_parallel_tool_calls():
    many = chat_constraint(req(tools=TOOLS, tool_choice="required"), "kimi_k3", False)
    one = chat_constraint(req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "kimi_k3", False)
    assert many.tool == "" and "maxItems" not in json.loads(many.structured.json_schema)
    assert json.loads(one.structured.json_schema)["maxItems"] == 1


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (dict(tools=[{"function": {}}], tool_choice="required"), "tools"),
    ],
)
def test_bad_combinations(kw, param):
    with pytest.raises(APIError) as e:
        chat_constraint(req(**kw), "kimi_k3", True)
    assert e.value.status == 400 and e.value.param == param


def test_forced_tool_calls():
    [c] = forced_tool_calls('{"a": 1}', "f", "kimi_k3")
    assert (c.id, c.name, json.loads(c.arguments_json)) == ("functions.f:1", "f", {"a": 1})
    calls = forced_tool_calls('[{"name":"f","parameters":{}},{"name":"g","parameters":{"x":[1]}}]', "", "kimi_linear")
    assert [(c.id, c.name, json.loads(c.arguments_json)) for c in calls] == [
        ("functions.f:0", "f", {}),
        ("functions.g:1", "g", {"x": [1]}),
    ]
    for text, tool in [('{"a": 1', "f"), ("[1]", "f"), ("[]", ""), ('[{"name":"f"}]', ""), ('{"a":1}', "")]:
        assert forced_tool_calls(text, tool, "kimi_k3") is None
