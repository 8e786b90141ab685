"""Request-time 400s with the field named (`param`), on chat and completions: `max_tokens` beyond
what max_model_len leaves after the prompt, `logit_bias` keys that are not token ids of the
vocabulary, a `pattern` too large for the grammar engine; `logit_bias` applies; `cache_salt`
isolates cached prefixes (the shared tiny K3 server of conftest.py, prefix caching on by default)."""

import random

import pytest

from tests.server.live_server import CHAT, CMPL, MAX_LEN, MODEL, http, idle_and_clean

NOTHINK = {"thinking": False}


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 1000) for _ in range(n)]


def refused(r, param: str) -> str:
    body = r.json()
    assert r.status_code == 400 and body["error"]["param"] == param, (r.status_code, body)
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def cmpl(server, **body):
    return http(server, "POST", CMPL, json={"model": MODEL, "temperature": 0, **body})


def chat(server, **body):
    msgs = [{"role": "user", "content": "hi"}]
    return http(server, "POST", CHAT, json={"model": MODEL, "messages": msgs, "temperature": 0, **NOTHINK, **body})


def test_max_tokens_beyond_the_context_is_400(server):
    prompt = ids(500, 1)
    msg = refused(cmpl(server, prompt=prompt, max_tokens=MAX_LEN - 499), "max_tokens")
    assert f"maximum context length is {MAX_LEN} tokens" in msg and "500 in the prompt" in msg
    r = cmpl(server, prompt=prompt, max_tokens=MAX_LEN - 500, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_LEN - 500
    refused(chat(server, max_tokens=MAX_LEN), "max_tokens")
    refused(chat(server, max_completion_tokens=MAX_LEN), "max_completion_tokens")
    assert chat(server, max_tokens=4).status_code == 200
    idle_and_clean(server["engine"])


@pytest.mark.parametrize("bias", [{"abc": 5}, {"-1": 5}, {"1.5": 5}, {"10000000": 1}, {"12": 101}])
def test_logit_bias_that_is_not_token_ids_is_400(server, bias):
    refused(cmpl(server, prompt="hi", max_tokens=2, logit_bias=bias), "logit_bias")
    refused(chat(server, max_tokens=2, logit_bias=bias), "logit_bias")


def test_logit_bias_past_the_vocabulary_is_400(server):
    vocab = server["engine"].core.model.config.vocab_size
    for send in (cmpl, chat):
        extra = {"prompt": "hi"} if send is cmpl else {}
        msg = refused(send(server, max_tokens=2, logit_bias={str(vocab): 1, "5": 1}, **extra), "logit_bias")
        assert str(vocab) in msg


def test_logit_bias_applies(server):
    tok = server["tok"]
    target = tok.encode(" banana")[0]
    r = cmpl(server, prompt="hi", max_tokens=4, logit_bias={str(target): 100}, ignore_eos=True)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode([target] * 4)
    r = cmpl(server, prompt="hi", max_tokens=4, logit_bias={str(target): -100, "7": 0}, ignore_eos=True)
    assert r.status_code == 200 and tok.decode([target]) not in r.json()["choices"][0]["text"]


HUGE = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{3000000}$"}}, "required": ["s"]}


def test_pattern_too_large_for_the_grammar_is_400(server):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": HUGE}}
    for r in (
        cmpl(server, prompt="hi", max_tokens=4, response_format=rf),
        chat(server, max_tokens=4, response_format=rf),
    ):
        assert "too large for the grammar engine" in refused(r, "response_format")
    tools = [{"type": "function", "function": {"name": "f", "parameters": HUGE}}]
    refused(chat(server, max_tokens=4, tools=tools, tool_choice="required"), "tool_choice")
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a{3}$"}}}
    r = cmpl(server, prompt="hi", max_tokens=8, response_format=ok)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == '"aaa"'


def hits(server) -> tuple[int, int]:
    s = server["engine"].call_sync(lambda c: c.cache.prefix_stats())
    return s["hits"], s["hit_tokens"]


def test_cache_salt_isolates_prefixes(server):
    prompt = ids(150, 2)  # two 64-token units can hit
    h0 = hits(server)
    for salt in ("tenant-a", "tenant-a", "tenant-b", None):
        extra = {} if salt is None else {"cache_salt": salt}
        assert cmpl(server, prompt=prompt, max_tokens=1, **extra).status_code == 200
    h1 = hits(server)
    assert (h1[0] - h0[0], h1[1] - h0[1]) == (1, 128)  # only tenant-a's second request hit
    text = "A conversation that is long enough to span whole units of the cache. " * 6
    msgs = [{"role": "user", "content": text}]
    for salt in ("x", "y", "x"):
        r = http(server, "POST", CHAT, json={"model": MODEL, "messages": msgs, "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 200
    h2 = hits(server)
    assert h2[0] - h1[0] == 1 and h2[1] > h1[1]
    refused(cmpl(server, prompt=prompt, max_tokens=1, cache_salt=""), "cache_salt")
    idle_and_clean(server["engine"])
