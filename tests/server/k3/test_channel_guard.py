"""K3 channel integrity by grammar (server/channel_guard.py, on by default): a fuzz over many
seeds of the tiny random K3, thinking on and off, with and without tools: every output parses
with no reasoning or XTML markup in `content` (nor markup in `reasoning_content`), and each
finished one is a well-formed message. Without the guard the same fuzz does leak (the test
engages). Plus the server default end to end (a reasoning budget's forced close included), the
`--no-channel-guard` switch and the preserved-thinking counter in /metrics."""

import argparse

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.chat.render import render_chat
from deltaserve.replica_front import replica_argv
from deltaserve.serve import add_arguments
from deltaserve.server.channel_guard import channel_guard
from deltaserve.server.parsers import control_token_ids, parse_output
from deltaserve.tiny import make_tiny
from tests.server.live_server import KEY, MODEL, live_server

MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
SEEDS = range(16)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("k3g"), family="kimi_k3", vision=False)
    return LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=16,
        page_size=16,
        kv_cache_memory=64 * 2**20,
        progress=False,
        max_model_len=512,
    )


def run(llm, thinking: bool, tools, guard: bool):
    tok = llm.tokenizer
    ids = render_chat(tok, "kimi_k3", USER, tools=tools, thinking=thinking)
    keep = control_token_ids(tok, "kimi_k3")
    names = [t["function"]["name"] for t in tools or []]
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=1.5,
            seed=s,
            keep_special_token_ids=keep,
            structured=channel_guard(thinking, names) if guard else None,
        )
        for s in SEEDS
    ]
    return [o.outputs[0] for o in llm.generate([ids] * len(SEEDS), params, use_tqdm=False)]


def leaks(text: str, thinking: bool, declared: bool) -> bool:
    p = parse_output(text, "kimi_k3", declared, thinking)
    return any(m in (p.content or "") for m in MARKERS) or any(m in (p.reasoning_content or "") for m in MARKERS)


def test_fuzz_no_markup_or_reasoning_in_content(llm):
    crossed = 0
    for thinking in (True, False):
        for tools in (None, TOOLS):
            for o in run(llm, thinking, tools, guard=True):
                assert o.finish_reason in ("stop", "length"), o.finish_reason  # never a grammar error
                assert not leaks(o.text, thinking, bool(tools)), o.text
                crossed += "<|close|>" in o.text
                if thinking and "<|close|>think<|sep|>" in o.text:
                    p = parse_output(o.text, "kimi_k3", bool(tools), thinking)
                    assert p.reasoning_content == o.text.split("<|close|>")[0]  # exactly the think element
                if o.finish_reason == "stop":
                    assert o.text.endswith("<|close|>message<|sep|>")
    assert crossed  # some outputs closed a channel: the structure was exercised


def test_without_the_guard_it_leaks(llm):
    texts = [o.text for t in (True, False) for o in run(llm, t, None, guard=False)]
    assert any(leaks(x, True, False) or leaks(x, False, False) for x in texts)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    with live_server(tmp_path_factory, MODEL, dict(api_key=KEY), max_model_len=512) as srv:  # the default: on
        yield srv


def post(srv, **body):
    body = {"model": MODEL, "max_tokens": 48, "temperature": 1.5, **body}
    return httpx.post(
        srv["url"] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


def test_server_flag_guards_replies(guarded):
    for seed in range(6):
        for extra in ({}, {"thinking": False}, {"tools": TOOLS}):
            r = post(guarded, messages=USER, seed=seed, **extra)
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            assert not any(m in (msg["content"] or "") for m in MARKERS), msg
            assert not any(m in (msg["reasoning_content"] or "") for m in MARKERS), msg


def metric(srv) -> float:
    text = httpx.get(srv["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next(x for x in text.splitlines() if x.startswith("deltaserve:k3_history_reasoning_omitted_total"))
    return float(line.split()[-1])


def test_preserved_thinking_counter(guarded):
    before = metric(guarded)
    kept = USER + [{"role": "assistant", "content": "A", "reasoning_content": "R"}, {"role": "user", "content": "Q"}]
    assert post(guarded, messages=kept, max_tokens=1).status_code == 200
    assert metric(guarded) == before
    dropped = USER + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "Q"}]
    assert post(guarded, messages=dropped, max_tokens=1).status_code == 200
    assert metric(guarded) == before + 1
    assert post(guarded, messages=dropped, max_tokens=1, thinking=False).status_code == 200
    assert metric(guarded) == before + 1  # thinking off: nothing to preserve


def test_reasoning_budget_under_the_guard(guarded):
    """`thinking_token_budget` on a guarded reply: the engine's forced think-close and
    response-open are inside the grammar, so the reply goes on in the response channel."""
    for seed in range(6):
        r = post(guarded, messages=USER, seed=seed, max_tokens=40, thinking_token_budget=3, logprobs=True)
        assert r.status_code == 200, r.text
        [c] = r.json()["choices"]
        tokens = [t["token"] for t in c["logprobs"]["content"]]
        assert "<|close|>" in tokens[:4] and not any(m in (c["message"]["content"] or "") for m in MARKERS)


def test_on_by_default_and_the_off_switch(guarded):
    """On for K3 unless `--no-channel-guard` (which data-parallel replicas inherit)."""
    assert guarded["app"].state.server.channel_guard
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).channel_guard is True
    off = p.parse_args(["--no-channel-guard"])
    assert off.channel_guard is False and "--no-channel-guard" in replica_argv(off, p, "m")
    assert "channel-guard" not in " ".join(replica_argv(p.parse_args([]), p, "m"))
