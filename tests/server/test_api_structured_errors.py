"""Structured outputs never fail silently: schemas refused with 400 at request time (compiled off
the event loop), grammar failures and forced tool choices without a call as errors, and the
reasoning budget that lets a thinking K3 reach its constrained answer (shared tiny K3 server)."""

import asyncio
import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from deltaserve.server.constraints import missing_forced_call  # noqa: E402
from tests.server.live_server import KEY, MODEL, http, idle_and_clean  # noqa: E402
from tests.server.test_api_structured import CLOCK, TOOLS, USER, WEATHER, valid  # noqa: E402

NOTHINK = {"thinking": False}
SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
NO_FINITE = (
    "the JSON schema admits no finite JSON value (a required property or array item recurses into itself without end)"
)


def rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def chat(server, **body):
    return http(server, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})


@pytest.mark.parametrize(
    "body,message",
    [
        (dict(response_format=rf(SELF)), NO_FINITE),
        (dict(response_format=rf(LOOP)), NO_FINITE),
        (dict(response_format=rf(SELF), thinking=False), NO_FINITE),
        (
            dict(
                tools=[{"type": "function", "function": {"name": "f", "parameters": SELF}}],
                tool_choice={"type": "function", "function": {"name": "f"}},
            ),
            NO_FINITE,
        ),
        (
            dict(response_format=rf({"type": "string", "pattern": "a" * 200_000})),
            "the JSON schema is too large (200030 bytes as compact JSON; at most 131072)",
        ),
    ],
)
def test_unusable_schemas_are_400(server, body, message):
    r = chat(server, max_tokens=8, **body)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    idle_and_clean(server["engine"])


def test_schema_compiles_off_the_event_loop(server, monkeypatch):
    """A slow compile neither runs on the event loop nor holds it: /health answers meanwhile."""
    core = server["engine"].core
    orig, seen = core.precompile, []

    def slow(params):
        try:
            asyncio.get_running_loop()
            seen.append("loop")
        except RuntimeError:
            seen.append(threading.current_thread().name)
        time.sleep(1.5)
        return orig(params)

    monkeypatch.setattr(core, "precompile", slow)
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("r", chat(server, max_tokens=40, response_format=rf(CLOCK), thinking=False))
    )
    t.start()
    time.sleep(0.3)
    start = time.time()
    assert http(server, "GET", "/health").status_code == 200
    assert time.time() - start < 1.0
    t.join(30)
    assert result["r"].status_code == 200 and seen and seen[0] not in ("loop", "deltaserve-engine")
    assert valid(json.loads(result["r"].json()["choices"][0]["message"]["content"]), CLOCK)


@pytest.fixture
def force_token(server, monkeypatch):
    """Replace the `k`-th sampled token of every constrained sequence by a fixed token."""
    engine, tok = server["engine"], server["tok"]
    plan = {}
    orig = engine.core.runner.execute

    def execute(scheduled, rows):
        out = orig(scheduled, rows)
        live = [r for r in rows if r is not None]
        out.token_ids = [
            plan["token"] if plan and r.grammar is not None and len(r.output_ids) == plan["k"] else t
            for t, r in zip(out.token_ids, live)
        ]
        return out

    monkeypatch.setattr(engine.core.runner, "execute", execute)
    yield lambda text, k: plan.update(token=tok.encode(text)[0], k=k)
    idle_and_clean(engine)


def sse_events(server, **body) -> list:
    """The parsed `data:` events of a streamed chat request ("[DONE]" kept as a string)."""
    with httpx.stream(
        "POST",
        server["url"] + "/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "messages": USER, "stream": True, **body},
    ) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    return [x if x == "[DONE]" else json.loads(x) for x in lines]


def test_grammar_failure_is_an_error(server, force_token):
    force_token("x", 2)  # not JSON: the grammar rejects it
    body = dict(max_tokens=40, seed=1, n=2, response_format=rf(WEATHER), thinking=False)
    r = chat(server, **body)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["message"].startswith("structured output failed: ")
    events = sse_events(server, **body)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert events[-2]["error"]["message"].startswith("structured output failed: ")
    assert not any(c.get("finish_reason") == "stop" for e in events[:-2] for c in e.get("choices", []))


NAMED = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})


def test_forced_tool_choice_without_call_is_an_error(server):
    body = dict(max_tokens=40, seed=2, stop=['"'], thinking=False, **NAMED)  # cuts the arguments
    r = chat(server, **body)
    assert r.status_code == 500
    assert r.json()["error"] == {"message": missing_forced_call(0), "type": "server_error", "param": None, "code": None}
    events = sse_events(server, **body)
    assert (
        events[-2]
        == {"error": {"message": missing_forced_call(0), "type": "server_error", "param": None, "code": None}}
        and events[-1] == "[DONE]"
    )
    r = chat(server, max_tokens=2, seed=2, thinking=False, tool_choice="required", tools=TOOLS)
    [c] = r.json()["choices"]  # cut by max_tokens: "length", as OpenAI, not an error
    assert c["finish_reason"] == "length" and not c["message"].get("tool_calls")
    idle_and_clean(server["engine"])


def reasoning_tokens(choice) -> int:
    """Tokens before the first control token (the think-close), from the logprobs entries."""
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    return tokens.index("<|close|>")


@pytest.mark.parametrize("field", ["thinking_token_budget", "max_reasoning_tokens"])
def test_thinking_budget_then_json(server, field):
    """Thinking on and random weights (they never close the think element themselves)."""
    body = dict(max_tokens=80, n=3, seed=4, logprobs=True, response_format=rf(WEATHER), **{field: 6})
    r = chat(server, **body)
    assert r.status_code == 200
    for c in r.json()["choices"]:
        assert reasoning_tokens(c) <= 6 and c["finish_reason"] == "stop"
        assert valid(json.loads(c["message"]["content"]), WEATHER)
    other = "max_reasoning_tokens" if field == "thinking_token_budget" else "thinking_token_budget"
    assert chat(server, **{**body, other: 6}).json()["choices"] == r.json()["choices"]
    streamed = {}
    for e in sse_events(server, **body)[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + (c["delta"].get("content") or "")
    assert streamed == {c["index"]: c["message"]["content"] for c in r.json()["choices"]}
    idle_and_clean(server["engine"])


def test_conflicting_budget_aliases(server):
    r = chat(server, max_tokens=4, thinking_token_budget=3, max_reasoning_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"


def test_default_budget_applies_to_constrained_requests(server, monkeypatch):
    monkeypatch.setattr(server["engine"].core, "structured_thinking_budget", 3)
    r = chat(server, max_tokens=80, seed=6, logprobs=True, response_format=rf(WEATHER))
    [c] = r.json()["choices"]
    assert reasoning_tokens(c) <= 3 and valid(json.loads(c["message"]["content"]), WEATHER)
    r = chat(server, max_tokens=80, seed=6, **NAMED)
    [c] = r.json()["choices"]
    [call] = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and valid(json.loads(call["function"]["arguments"]), CLOCK)
    assert c["finish_reason"] == "stop"
    idle_and_clean(server["engine"])
