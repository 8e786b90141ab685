"""The real server (uvicorn on a loopback port, a tiny random K3) driven by the `openai` client.
The `server` / `client` fixtures (one server for the package) are in conftest.py."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.server.live_server import CMPL, KEY, MAX_LEN, MODEL, TOOLS, http, idle_and_clean, script_outputs, unguarded  # noqa: E402

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
    """Force the sampled tokens to SCRIPT then EOS (the model still runs every step), unguarded."""
    engine, tok = server["engine"], server["tok"]
    script = tok.encode(SCRIPT, allow_special=True) + [min(engine.core.eos_ids)]
    undo = script_outputs(engine, script)
    with unguarded(server):
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
