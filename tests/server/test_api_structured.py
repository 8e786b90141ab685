"""The `openai` client against the real server: enforced response_format and tool_choice,
batched completions and echo (tiny random K3; the shared `server` / `client` of conftest.py)."""

import json

import pytest

openai = pytest.importorskip("openai")

from deltaserve.chat.render import render_chat  # noqa: E402
from tests.server.live_server import MODEL, idle_and_clean  # noqa: E402

NOTHINK = {"thinking": False}
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days", "metric"],
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
}
CLOCK = {
    "type": "object",
    "additionalProperties": False,
    "required": ["tz"],
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]


def valid(v, schema) -> bool:
    """Independent check of the two flat enum/int/bool schemas above."""
    if not isinstance(v, dict) or set(v) != set(schema["required"]):
        return False
    for k, spec in schema["properties"].items():
        x = v[k]
        if "enum" in spec and x not in spec["enum"]:
            return False
        if spec.get("type") == "integer" and not (type(x) is int and spec["minimum"] <= x <= spec["maximum"]):
            return False
        if spec.get("type") == "boolean" and type(x) is not bool:
            return False
    return True


def test_json_object_is_json(client, server):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        n=8,
        max_tokens=48,
        seed=2,
        response_format={"type": "json_object"},
        extra_body=NOTHINK,
    )
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    assert stopped, [c.message.content for c in r.choices]
    for c in stopped:
        assert isinstance(json.loads(c.message.content), dict) and not c.message.tool_calls
    for c in r.choices:  # cut by max_tokens: still no control token, and an object's opening
        assert c.message.content.startswith("{") and "<|" not in c.message.content
    idle_and_clean(server["engine"])


def test_json_schema_enforced_stream_equals_non_stream(client):
    kw = dict(
        model=MODEL,
        messages=USER,
        n=3,
        max_tokens=60,
        seed=11,
        temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}},
        extra_body=NOTHINK,
    )
    r = client.chat.completions.create(**kw)
    for c in r.choices:
        assert c.finish_reason == "stop" and valid(json.loads(c.message.content), WEATHER), c.message.content
    streamed = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {c.index: c.message.content for c in r.choices}


def _calls(choice):
    return [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or []]


def test_named_tool_choice(client):
    kw = dict(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        n=2,
        max_tokens=60,
        seed=5,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        extra_body=NOTHINK,
    )
    r = client.chat.completions.create(**kw)
    for c in r.choices:
        [(name, args)] = _calls(c)
        assert name == "get_time" and valid(args, CLOCK) and c.message.content is None
        assert c.finish_reason == "stop" and c.message.tool_calls[0].id
    streamed = {}
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            assert not c.delta.content
            for t in c.delta.tool_calls or []:
                streamed.setdefault(c.index, []).append((t.function.name, json.loads(t.function.arguments)))
    assert streamed == {c.index: _calls(c) for c in r.choices}


def test_required_tool_choice(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        n=4,
        max_tokens=80,
        seed=9,
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=NOTHINK,
    )
    names = set()
    for c in r.choices:
        [(name, args)] = _calls(c)
        assert valid(args, {"get_weather": WEATHER, "get_time": CLOCK}[name]), args
        assert c.finish_reason == "tool_calls"
        names.add(name)
    assert names <= {"get_weather", "get_time"}


@pytest.fixture
def script_prefix(server, monkeypatch):
    """Force the first sampled tokens of every sequence to a script; later tokens are the
    sampler's own (masked) choices."""
    engine, tok = server["engine"], server["tok"]
    script: list[int] = []
    orig = engine.core.runner.execute

    def execute(scheduled, rows):
        out = orig(scheduled, rows)
        done = [s for s, r in zip(scheduled, rows) if r is not None]
        for j, s in enumerate(done):
            if len(s.seq.output_ids) < len(script):
                out.token_ids[j] = script[len(s.seq.output_ids)]
        return out

    monkeypatch.setattr(engine.core.runner, "execute", execute)
    yield lambda text: script.extend(tok.encode(text, allow_special=True))
    idle_and_clean(engine)


def test_thinking_then_constrained_answer(client, script_prefix):
    """K3 thinking on: free reasoning, the forced think-close, then the constrained JSON."""
    script_prefix("first some reasoning<|close|>think<|sep|>")
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=80,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
    )
    c = r.choices[0]
    assert c.message.reasoning_content == "first some reasoning" and c.finish_reason == "stop"
    assert valid(json.loads(c.message.content), WEATHER), c.message.content


def test_batched_completions(client):
    kw = dict(model=MODEL, max_tokens=5, seed=7, temperature=1.0, n=2, extra_body={"ignore_eos": True})
    for prompts in (["Hello", "Once upon a time"], [[1, 2, 3], [4, 5], [6]]):
        r = client.completions.create(prompt=prompts, **kw)
        assert [c.index for c in r.choices] == list(range(2 * len(prompts)))
        singles = [client.completions.create(prompt=p, **kw) for p in prompts]
        assert [c.text for c in r.choices] == [c.text for s in singles for c in s.choices]
        assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        assert r.usage.completion_tokens == 10 * len(prompts)
        streamed = {}
        for ch in client.completions.create(prompt=prompts, stream=True, **kw):
            for c in ch.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        assert streamed == {c.index: c.text for c in r.choices}


def test_echo(client, server):
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="Hello there", **kw).choices[0].text
    r = client.completions.create(prompt=["Hello there", "Hi"], echo=True, **kw)
    hi = client.completions.create(prompt="Hi", **kw).choices[0].text
    assert [c.text for c in r.choices] == ["Hello there" + plain, "Hi" + hi]
    ids_text = client.completions.create(prompt=[1, 2, 3], **kw).choices[0].text
    r = client.completions.create(prompt=[1, 2, 3], echo=True, **kw)
    assert r.choices[0].text == server["tok"].decode([1, 2, 3]) + ids_text
    streamed = "".join(
        ch.choices[0].text for ch in client.completions.create(prompt="Hello there", echo=True, stream=True, **kw)
    )
    assert streamed == "Hello there" + plain


def test_completion_response_format(client):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    r = client.completions.create(
        model=MODEL, prompt=["a", "b"], n=2, max_tokens=60, seed=4, extra_body={"response_format": rf}
    )
    for c in r.choices:
        assert c.finish_reason == "stop" and valid(json.loads(c.text), WEATHER), c.text


def test_suffix_refused_like_vllm(client):
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="x", suffix="y", max_tokens=2)


def test_control_messages_reach_the_prompt(client, server):
    """prompt_tokens equals the independently rendered prompt with the request's controls."""
    tok = server["tok"]
    kw = dict(model=MODEL, messages=USER, max_tokens=1)
    r = client.chat.completions.create(reasoning_effort="high", **kw)
    assert r.usage.prompt_tokens == len(render_chat(tok, "kimi_k3", USER, controls=(("thinking_effort", "high"),)))
    r = client.chat.completions.create(tools=TOOLS[1:], tool_choice="none", extra_body=NOTHINK, **kw)
    want = render_chat(tok, "kimi_k3", USER, tools=TOOLS[1:], thinking=False, controls=(("tool_choice", "none"),))
    assert r.usage.prompt_tokens == len(want) - 3  # the non-thinking response opener is not counted
