"""K3 channel integrity by grammar (`--channel-guard`, server/channel_guard.py): a fuzz over many
seeds of the tiny random K3, thinking on and off, with and without tools: every output parses
with no reasoning or XTML markup in `content` (nor markup in `reasoning_content`), and each
finished one is a well-formed message. Without the guard the same fuzz does leak (the test
engages). Plus the server flag end to end and the preserved-thinking counter in /metrics."""

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.chat.render import render_chat
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
    with live_server(tmp_path_factory, MODEL, dict(api_key=KEY, channel_guard=True), max_model_len=512) as srv:
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
