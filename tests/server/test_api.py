"""The real server (uvicorn on a loopback port, a tiny random K3) driven by the `openai` client.
The `server` / `client` fixtures (one server for the package) are in conftest.py."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.server.live_server import KEY, MAX_LEN, MODEL, http, idle_and_clean, script_outputs  # noqa: E402

IGN = {"ignore_eos": True}


def test_models_health_ready(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http(server, "GET", "/health", key=None).json() == {"status": "ok"}
    assert http(server, "GET", "/ready").json()["status"] == "ready"


def test_completion_usage_matches_tokenizer(server, client):
    prompt = "Hello, world"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, logprobs=2, extra_body=IGN)
    c = r.choices[0]
    assert r.usage.prompt_tokens == len(server["tok"].encode(prompt))
    assert r.usage.completion_tokens == 7 and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == 7 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert c.logprobs.text_offset == sorted(c.logprobs.text_offset)
    tk = http(server, "POST", "/tokenize", json={"prompt": prompt}).json()
    assert tk["count"] == r.usage.prompt_tokens and tk["max_model_len"] == MAX_LEN
    assert http(server, "POST", "/detokenize", json={"tokens": tk["tokens"]}).json()["prompt"] == prompt


def test_seeded_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=12, temperature=1.0, seed=1234, extra_body=IGN)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == a
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    other = client.completions.create(**{**kw, "seed": 99}).choices[0].text
    assert other != a


def test_n_choices(client):
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], n=3, max_tokens=5, seed=7, extra_body=IGN)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens == 4
    assert len({c.text for c in r.choices}) > 1
    streamed = {}
    for ch in client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4], n=3, max_tokens=5, seed=7, stream=True, extra_body=IGN
    ):
        streamed[ch.choices[0].index] = streamed.get(ch.choices[0].index, "") + ch.choices[0].text
    assert streamed == {c.index: c.text for c in r.choices}


def test_stop_string(client):
    kw = dict(model=MODEL, prompt="abc", max_tokens=30, temperature=0, extra_body=IGN)
    full = client.completions.create(**kw).choices[0].text
    stop = full[8:11]
    cut = full[: full.index(stop)]
    r = client.completions.create(stop=[stop], **kw).choices[0]
    assert r.text == cut and r.finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == cut


def test_chat_stream_equals_non_stream(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=10,
        seed=5,
        temperature=0.8,
        extra_body=IGN,
    )
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    full = (msg.content or "", getattr(msg, "reasoning_content", None) or "")
    assert any(full) and r.usage.completion_tokens == 10
    content, reasoning, usage = "", "", None
    for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
    assert (content, reasoning) == full
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == 10


def test_chat_logprobs_and_n(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        n=2,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
        seed=3,
        extra_body=IGN,
    )
    assert len(r.choices) == 2 and r.usage.completion_tokens == 8
    for c in r.choices:
        assert len(c.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in c.logprobs.content)


def test_api_key(server):
    assert http(server, "GET", "/v1/models", key=None).status_code == 401
    r = http(server, "GET", "/v1/models", key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http(server, "GET", "/health", key=None).status_code == 200


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
BAD = [
    (CMPL, {"prompt": "x"}, 400),  # no model
    (CMPL, {"model": "nope", "prompt": "x"}, 404),
    (CMPL, {"model": MODEL}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "top_p": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": 1000}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "logprobs": 100}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop": ["s"] * 40}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop": [""]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "seed": "1"}, 400),
    (CMPL, {"model": MODEL, "prompt": []}, 400),
    (CMPL, {"model": MODEL, "prompt": [10**9]}, 400),
    (CMPL, {"model": MODEL, "prompt": [1] * (MAX_LEN + 1)}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400),
    (CHAT, {"model": MODEL, "messages": []}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": ""}]}, 400),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "top_logprobs": 2}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "tools": [{"function": {}}]}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "presence_penalty": 5}, 400),
    ("/tokenize", {"prompt": "a", "messages": USER}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "temperature": 3}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "min_p": -0.1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "top_k": -5}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": 1.5}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "n": True}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "logprobs": -1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop": ["y" * 1000]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stop_token_ids": list(range(100))}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "frequency_penalty": -3}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "min_tokens": -1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": "yes"}}, 400),
    (CMPL, {"model": MODEL, "prompt": "x" * 4000}, 400),  # over max_model_len after encoding
    (CMPL, {"model": 5, "prompt": "x"}, 400),
    (CHAT, {"model": MODEL}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "n": 17}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "top_logprobs": 100, "logprobs": True}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "logprobs": "yes"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "max_completion_tokens": 0}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "tool_choice": "sometimes"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "tools": "get_weather"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": "yaml"}}, 400),
    (CHAT, {"model": MODEL, "messages": [{"content": "no role"}]}, 400),
    (CHAT, {"model": MODEL, "messages": ["hi"]}, 400),
    (CHAT, {"model": "other", "messages": USER}, 404),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4000}]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/tokenize", {}, 400),
    # batched completions, echo, suffix
    (CMPL, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "echo": "yes"}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a"] * 65}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a"] * 5, "n": 16}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a", ""]}, 400),
    (CMPL, {"model": MODEL, "prompt": [[1, 2], []]}, 400),
    (CMPL, {"model": MODEL, "prompt": [[1, 2], [10**9]]}, 400),
    (CMPL, {"model": MODEL, "prompt": [[1, 2], [1] * (MAX_LEN + 1)]}, 400),
    (CMPL, {"model": MODEL, "prompt": [["a"]]}, 400),
    (CMPL, {"model": MODEL, "prompt": ["a", 1]}, 400),
    (CMPL, {"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema"}}, 400),
    (
        CMPL,
        {
            "model": MODEL,
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        400,
    ),
    # response_format
    (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema"}}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "response_format": {"type": "json_object", "json_schema": 5}}, 400),
    (
        CHAT,
        {"model": MODEL, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "s"}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}},
            },
        },
        400,
    ),
    (CHAT, {"model": MODEL, "messages": USER, "response_format": "json_object"}, 400),
    # tool_choice and control fields
    (CHAT, {"model": MODEL, "messages": USER, "tool_choice": "required"}, 400),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        400,
    ),
    (
        CHAT,
        {"model": MODEL, "messages": USER, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        400,
    ),
    (CHAT, {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "function"}}, 400),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": ""}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "tool", "function": {"name": "get_weather"}},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": USER,
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": "a"}}}
            ],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        400,
    ),
    (
        CHAT,
        {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
        400,
    ),
    (CHAT, {"model": MODEL, "messages": USER, "reasoning_effort": "extreme"}, 400),
    (CHAT, {"model": MODEL, "messages": USER, "thinking_effort": 3}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_malformed_request(server, path, body, status):
    r = http(server, "POST", path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    ok = http(server, "POST", CMPL, json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    "content,status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"model": "tiny-k3", "prompt": "x", "temperature": NaN}', 400),
        (b"x" * (2 << 20), 413),
    ],
)
def test_raw_bodies(server, content, status):
    r = http(server, "POST", CMPL, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status and "error" in r.json()
    assert http(server, "GET", "/nope").status_code == 404
    assert http(server, "GET", CMPL).status_code == 405


def test_chunked_body_cap(server):
    """No Content-Length (chunked): the cap is enforced while the body streams in."""

    def chunks(n, size=1 << 16):
        for _ in range(n):
            yield b" " * size

    r = http(server, "POST", CMPL, content=chunks(64), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "over" in r.json()["error"]["message"]
    body = json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 2}).encode()
    ok = http(server, "POST", CMPL, content=iter([body[:10], body[10:]]), headers={"Content-Type": "application/json"})
    assert "content-length" not in ok.request.headers and ok.status_code == 200, ok.text


def test_aborted_stream_frees_cache(server):
    engine = server["engine"]
    before = idle_and_clean(engine)["requests_aborted"]
    body = {"model": MODEL, "prompt": "abort me", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", server["url"] + CMPL, json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [json.loads(ln[6:]) for ln in (next(lines) for _ in range(3)) if ln.startswith("data: {")]
        assert got
    stats = idle_and_clean(engine)
    assert stats["requests_aborted"] == before + 1
    ok = http(server, "POST", CMPL, json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


SCRIPT = (
    "need the weather<|close|>think<|sep|><|open|>response<|sep|>checking<|close|>response<|sep|>"
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    "<|close|>call<|sep|><|close|>tools<|sep|>"
)


@pytest.fixture
def scripted(server):
    """Force the sampled tokens to SCRIPT then EOS (the model still runs every step)."""
    engine, tok = server["engine"], server["tok"]
    script = tok.encode(SCRIPT, allow_special=True) + [min(engine.core.eos_ids)]
    undo = script_outputs(engine, script)
    yield
    undo()
    idle_and_clean(engine)


def test_tool_calls_from_scripted_output(client, scripted):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "checking"
    assert c.message.reasoning_content == "need the weather"
    [call] = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    calls, content, reasoning, finish = [], "", "", None
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        calls += d.tool_calls or []
        finish = ch.choices[0].finish_reason or finish
    assert (content, reasoning, finish) == ("checking", "need the weather", "tool_calls")
    assert [(t.id, t.function.name, t.function.arguments) for t in calls] == [
        (call.id, call.function.name, call.function.arguments)
    ]
    plain = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert not plain.message.tool_calls and "get_weather" in plain.message.content
