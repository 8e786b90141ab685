"""The K3 API contract over raw HTTP and the official `openai` client, streamed and not: the
thinking controls and their precedence, tool_choice rules, dynamic tools, assistant prefill,
images in tool messages, and a 400 naming the field for each malformed shape. The prompt is
checked through `usage.prompt_tokens` against `render_chat` with the settings the contract says."""

import json

import httpx
import pytest

from deltaserve.chat.render import render_chat
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.tiny.presets import MEDIA_PROC_CFG
from tests.server.live_server import KEY, MODEL, live_server

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_G = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAh"
    "KmMIQAAAABJRU5ErkJggg=="
)


def post(server, body: dict, stream: bool = False):
    body = {"model": MODEL, "max_tokens": 1, **body}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server["url"] + "/v1/chat/completions"
    if not stream:
        return httpx.post(url, json=body, headers=headers, timeout=60)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    return httpx.post(url, json=body, headers=headers, timeout=60)


def tokens(server, body: dict) -> int:
    """usage.prompt_tokens, non-streamed and streamed (equal)."""
    r = post(server, body)
    assert r.status_code == 200, r.text
    s = post(server, body, stream=True)
    usage = [json.loads(x[6:]).get("usage") for x in s.text.splitlines() if x.startswith("data: {")]
    assert [u["prompt_tokens"] for u in usage if u] == [r.json()["usage"]["prompt_tokens"]]
    return r.json()["usage"]["prompt_tokens"]


KNOWN = {"messages", "tools", "tool_choice", "reasoning_effort", "max_tokens", "response_format", "temperature"}


def client_kwargs(body: dict) -> dict:
    """`body` as openai client keywords: fields the client does not know go in `extra_body`."""
    extra = {k: v for k, v in body.items() if k not in KNOWN}
    return {"model": MODEL, "max_tokens": 1, **{k: v for k, v in body.items() if k in KNOWN}, "extra_body": extra}


def client_tokens(client, body: dict) -> int:
    """usage.prompt_tokens through the official openai client, non-streamed and streamed (equal)."""
    plain = client.chat.completions.create(**client_kwargs(body)).usage.prompt_tokens
    stream = client.chat.completions.create(**client_kwargs(body), stream=True, stream_options={"include_usage": True})
    assert [c.usage.prompt_tokens for c in stream if c.usage] == [plain]
    return plain


def rendered(server, messages=USER, thinking=True, counted=True, **kw) -> int:
    n = len(render_chat(server["tok"], "kimi_k3", messages, thinking=thinking, **kw))
    return n - (3 if counted and not thinking else 0)


def test_thinking_shapes_and_precedence(server):
    on, off = rendered(server), rendered(server, thinking=False)
    assert on != off
    assert tokens(server, {"messages": USER}) == on
    assert tokens(server, {"messages": USER, "thinking": {"type": "enabled", "keep": "all"}}) == on
    assert tokens(server, {"messages": USER, "thinking": {"type": "disabled"}}) == off
    assert tokens(server, {"messages": USER, "thinking": False}) == off
    assert tokens(server, {"messages": USER, "chat_template_kwargs": {"thinking": False}}) == off
    # chat_template_kwargs wins over the thinking object
    both = {"chat_template_kwargs": {"thinking": True}, "thinking": {"type": "disabled"}}
    assert tokens(server, {"messages": USER, **both}) == on


def test_effort_precedence(server):
    def effort(e):
        return rendered(server, controls=(("thinking_effort", e),))

    assert tokens(server, {"messages": USER, "reasoning_effort": "low"}) == effort("low")
    assert tokens(server, {"messages": USER, "thinking": {"type": "enabled", "effort": "high"}}) == effort("high")
    body = {"messages": USER, "reasoning_effort": "low", "thinking_effort": "high"}
    assert tokens(server, body) == effort("high")
    body = {
        **body,
        "thinking": {"type": "enabled", "effort": "low"},
        "chat_template_kwargs": {"thinking_effort": "max"},
    }
    assert tokens(server, body) == effort("max")
    # no effort with thinking off
    assert tokens(server, {"messages": USER, "reasoning_effort": "low", "thinking": False}) == rendered(
        server, thinking=False
    )


def test_named_tool_choice_turns_thinking_off(server):
    named = {"type": "function", "function": {"name": "f"}}
    body = {"messages": USER, "tools": [TOOL], "tool_choice": named, "max_tokens": 64}
    want = rendered(server, thinking=False, tools=[TOOL], controls=(("tool_choice", "required"),))
    assert tokens(server, body) == want


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_tool_choice_without_tools_is_accepted(server, choice):
    assert tokens(server, {"messages": USER, "tool_choice": choice}) == rendered(server)


def test_dynamic_tools(server, client):
    msgs = USER + [{"role": "system", "content": "", "tools": [TOOL]}]
    assert tokens(server, {"messages": msgs}) == rendered(server, msgs)
    # "required" satisfied by dynamic tools alone
    body = {"messages": msgs, "tool_choice": "required", "max_tokens": 64, "thinking": False}
    want = rendered(server, msgs, thinking=False, controls=(("tool_choice", "required"),))
    assert tokens(server, body) == want
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[TOOL_G], max_tokens=1)
    assert r.usage.prompt_tokens == rendered(server, msgs, tools=[TOOL_G])


def test_partial_prefill(server, client):
    msgs = USER + [{"role": "assistant", "content": "Hel", "partial": True}]
    want = rendered(server, msgs, counted=False)
    assert tokens(server, {"messages": msgs}) == want
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens == want
    text = server["tok"].decode(render_chat(server["tok"], "kimi_k3", msgs))
    assert text.endswith("<|open|>response<|sep|>Hel")


def test_keep_all_renders_earlier_reasoning(server):
    """`thinking.keep`: "all" or absent renders every earlier turn's reasoning_content (the
    reference encoder has no drop mode); any other value is a 400 naming `thinking.keep`."""
    said = {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}
    msgs = USER + [said, {"role": "user", "content": "Again"}]
    dropped = msgs[:1] + [{"role": "assistant", "content": "Hello"}] + msgs[2:]
    kept = rendered(server, msgs)
    assert kept > rendered(server, dropped)
    assert tokens(server, {"messages": msgs, "thinking": {"type": "enabled", "keep": "all"}}) == kept
    assert tokens(server, {"messages": msgs, "thinking": {"type": "enabled"}}) == kept
    off = {"type": "disabled", "keep": "all"}  # no think elements at all with thinking off
    assert tokens(server, {"messages": msgs, "thinking": off}) == rendered(server, msgs, thinking=False)
    for keep in ("none", "last", True, 0):
        r = post(server, {"messages": USER, "thinking": {"type": "enabled", "keep": keep}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking.keep", r.text


def test_streamed_usage_with_tools_and_thinking_off(server, client):
    """usage.prompt_tokens streamed (include_usage) equals the non-streamed count, with tools,
    tool history and thinking off (`tokens` checks both)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = USER + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    for body in ({"thinking": {"type": "disabled"}}, {"chat_template_kwargs": {"thinking": False}}):
        want = rendered(server, msgs, thinking=False, tools=[TOOL])
        assert tokens(server, {"messages": msgs, "tools": [TOOL], **body}) == want
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        tools=[TOOL],
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert [c.usage.prompt_tokens for c in stream if c.usage] == [want]


def contract_cases(server) -> list[tuple[dict, int]]:
    """(request body, its prompt tokens as the contract says) for each accepted shape."""
    named = {"type": "function", "function": {"name": "f"}}
    dyn = USER + [{"role": "system", "content": "", "tools": [TOOL]}]
    partial = USER + [{"role": "assistant", "content": "Hel", "partial": True}]
    required = (("tool_choice", "required"),)
    return [
        ({"messages": USER, "thinking": {"type": "disabled"}}, rendered(server, thinking=False)),
        ({"messages": USER, "thinking": {"type": "enabled", "keep": "all"}}, rendered(server)),
        ({"messages": USER, "chat_template_kwargs": {"thinking": False}}, rendered(server, thinking=False)),
        ({"messages": USER, "reasoning_effort": "low"}, rendered(server, controls=(("thinking_effort", "low"),))),
        (
            {"messages": USER, "thinking": {"type": "enabled", "effort": "high"}, "thinking_effort": "low"},
            rendered(server, controls=(("thinking_effort", "high"),)),
        ),
        (
            {"messages": USER, "tools": [TOOL], "tool_choice": named, "max_tokens": 64, "temperature": 0},
            rendered(server, thinking=False, tools=[TOOL], controls=required),
        ),
        ({"messages": USER, "tool_choice": "none"}, rendered(server)),
        ({"messages": USER, "tool_choice": "auto"}, rendered(server)),
        ({"messages": dyn, "tools": [TOOL_G]}, rendered(server, dyn, tools=[TOOL_G])),
        (
            {"messages": dyn, "tool_choice": "required", "thinking": False, "max_tokens": 64, "temperature": 0},
            rendered(server, dyn, thinking=False, controls=required),
        ),
        ({"messages": partial}, rendered(server, partial, counted=False)),
    ]


def test_contract_over_the_openai_client_and_raw_http(server, client):
    """Every accepted shape gives the same prompt over raw HTTP and the openai client, streamed
    and not."""
    for body, want in contract_cases(server):
        assert (tokens(server, body), client_tokens(client, body)) == (want, want), body


def test_required_met_by_dynamic_tools_alone(client):
    """tool_choice "required" with only a dynamic tool declared: the reply calls it (its
    arguments can only be `{}`, so the random model finishes the call)."""
    none = {"type": "object", "properties": {}, "additionalProperties": False}
    dyn = {"type": "function", "function": {"name": "now", "parameters": none}}
    msgs = USER + [{"role": "system", "content": "", "tools": [dyn]}]
    body = {"messages": msgs, "tool_choice": "required", "max_tokens": 64, "temperature": 0, "thinking": False}
    r = client.chat.completions.create(**client_kwargs(body))
    assert r.choices[0].finish_reason == "tool_calls", r
    calls = {(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls}
    assert calls == {("now", "{}")}
    stream = client.chat.completions.create(**client_kwargs(body), stream=True)
    names = [t.function.name for c in stream for t in (c.choices[0].delta.tool_calls or []) if t.function.name]
    assert names and set(names) == {"now"}


@pytest.mark.parametrize("tool_call_id", [None, "", 7])
def test_tool_message_needs_tool_call_id(server, tool_call_id):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    result = {"role": "tool", "content": "ok", "name": "f"}
    if tool_call_id is not None:
        result["tool_call_id"] = tool_call_id
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": [call]}, result]
    for stream in (False, True):
        r = post(server, {"messages": msgs, "tools": [TOOL]}, stream=stream)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages[2].tool_call_id", r.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "bogus", "tools": [TOOL]}, "tool_choice"),
        ({"tool_choice": {"type": "function"}, "tools": [TOOL]}, "tool_choice.function"),
        ({"tool_choice": {"type": "function", "function": {}}, "tools": [TOOL]}, "tool_choice.function.name"),
    ],
)
def test_union_fields_are_named_plainly(server, body, param):
    """A field with several accepted shapes is named by its own path, not the validator's name
    for the shape it tried (`tool_choice.literal['none','auto','required']`)."""
    r = post(server, {"messages": USER, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def vserver(tmp_path_factory):
    """A tiny-K3 server that accepts images."""
    kwargs = dict(api_key=KEY, image_processor=ImageProcessor(MEDIA_PROC_CFG))
    with live_server(tmp_path_factory, MODEL, kwargs, max_model_len=512) as srv:
        yield srv


def test_image_in_tool_message(vserver):
    server = vserver
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    image = [{"type": "text", "text": "shot:"}, {"type": "image_url", "image_url": {"url": PNG}}]
    msgs = USER + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": image},
    ]
    plain = msgs[:-1] + [{"role": "tool", "tool_call_id": "c", "content": "shot:"}]
    with_image, without = (
        tokens(server, {"messages": msgs, "tools": [TOOL]}),
        tokens(server, {"messages": plain, "tools": [TOOL]}),
    )
    assert with_image > without + 2  # the image's media block is in the prompt
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client_tokens(client, {"messages": msgs, "tools": [TOOL]}) == with_image


@pytest.mark.parametrize(
    "body,param",
    [
        ({"thinking": {"type": "on"}}, "thinking"),
        ({"thinking": {"type": "enabled", "keep": "some"}}, "thinking"),
        ({"thinking": {"type": "enabled", "effort": "medium"}}, "thinking"),
        ({"reasoning_effort": "medium"}, "reasoning_effort"),
        ({"thinking_effort": "extreme"}, "thinking_effort"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
        ),
        ({"messages": [{"role": "user", "content": "x", "tools": [TOOL]}]}, "messages[0].tools"),
        ({"messages": [{"role": "system", "content": "x", "tools": [TOOL]}, *USER]}, "messages[0].tools"),
        ({"messages": [{"role": "system", "tools": [TOOL]}, *USER], "tools": [TOOL]}, "tools"),
        ({"messages": [{"role": "system", "tools": [{"function": {}}]}, *USER]}, "messages[0].tools"),
        ({"messages": [{"role": "assistant", "content": "x", "partial": True}, *USER]}, "messages"),
        ({"messages": USER + [{"role": "assistant", "content": "x", "partial": "yes"}]}, "messages"),
    ],
)
def test_malformed_shapes_are_400_naming_the_field(server, client, body, param):
    for stream in (False, True):
        r = post(server, {"messages": USER, **body}, stream=stream)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] is not None and err["param"].startswith(param), err
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**client_kwargs({"messages": USER, **body}), stream=stream)
        assert e.value.param is not None and e.value.param.startswith(param), e.value.body
