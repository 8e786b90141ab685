"""Proxy + prefill + decode instances (one process each, in threads here) against the colocated
engine, fp32, both families: a multi-turn, branching workload gives the same greedy tokens;
follow-up turns hit the decode side's own prefix cache and move only their new suffix; every
handoff moves exactly the MLA bytes of its tokens plus one KDA state, computed from config.json;
the official openai client streams through the proxy; both sides end with clean pools."""

from __future__ import annotations

import json
import random
import re

import httpx
import openai
import pytest

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.tiny import make_tiny

from .pd_fixtures import ENGINE, UNIT, idle_and_clean, instance, make_llm, need_mooncake, proxy, state

need_mooncake()

MAX_TOKENS = 6


def expected_bytes(ckpt, num_tokens: int) -> tuple[int, int]:
    """(MLA bytes of `num_tokens` positions, one KDA state) in fp32, from config.json alone."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    lin = cfg["linear_attn_config"]
    row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    heads, dk = lin["num_heads"], lin["head_dim"]
    tail = (lin["short_conv_kernel_size"] - 1) * 3 * heads * dk * 4
    return len(lin["full_attn_layers"]) * row * num_tokens, len(lin["kda_layers"]) * (tail + heads * dk * dk * 4)


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def deployment(request, tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("pd") / request.param, request.param, "tiny", seed=5)
    with instance(ckpt, "prefill") as p, instance(ckpt, "decode") as d, proxy([p[0]], [d[0]]) as x:
        yield {"ckpt": ckpt, "prefill": p, "decode": d, "proxy": x, "ref": make_llm(ckpt)}


def _workload(seed: int) -> list[tuple[str, list[int] | None, list[int]]]:
    """(name, parent turn name or None, new tokens): a conversation of three turns and a branch."""
    rng = random.Random(seed)
    new = lambda n: [rng.randrange(10, 1700) for _ in range(n)]  # noqa: E731
    return [("t1", None, new(70)), ("t2", "t1", new(37)), ("b2", "t1", new(21)), ("t3", "t2", new(29))]


def test_multi_turn_branching_equals_colocated(deployment):
    ckpt, ref = deployment["ckpt"], deployment["ref"]
    client = openai.OpenAI(base_url=deployment["proxy"][0] + "/v1", api_key="none")
    decode_url = deployment["decode"][0]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    history: dict[str, list[int]] = {}
    for name, parent, new in _workload(1):
        prompt = (history[parent] if parent else []) + new
        want = ref.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0]
        before = state(decode_url)
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        after = state(decode_url)
        assert got.choices[0].text == want.text, name
        assert after["handoffs"] == before.get("handoffs", 0) + 1, name
        start = after.get("hit_tokens", 0) - before.get("hit_tokens", 0)
        mla, kda = expected_bytes(ckpt, len(prompt) - 1 - start)
        assert after["bytes_mla"] - before.get("bytes_mla", 0) == mla, name
        assert after["bytes_kda"] - before.get("bytes_kda", 0) == kda, name
        if parent is None:
            assert start == 0
        else:  # the decode side holds the parent turn's prompt (whole units of it): only the rest moves
            assert start >= (len(history[parent]) - 1) // UNIT * UNIT - UNIT and start > 0, (name, start)
        history[name] = prompt + list(want.token_ids)
    metrics = httpx.get(decode_url + "/metrics", timeout=30).text
    final = state(decode_url)
    assert not [k for k in final if k.startswith("bypass_")], final  # every turn went by handoff
    for key in ("bytes_mla", "bytes_kda", "handoffs", "hit_tokens"):
        assert re.search(rf"^deltaserve:disagg_{key}_total{{[^}}]*}} {final[key]}\.0$", metrics, re.M), key
    routed = deployment["proxy"][1].counters
    assert routed["routed_mla_only"] + routed["routed_joint_hit"] >= 3
    proxy_url = deployment["proxy"][0]
    assert httpx.get(proxy_url + "/health", timeout=30).json() == {"status": "ok"}
    proxy_metrics = httpx.get(proxy_url + "/metrics", timeout=30).text
    assert f"deltaserve:proxy_requests {routed['requests']}" in proxy_metrics
    idle_and_clean(deployment["prefill"][0])
    idle_and_clean(decode_url)


def test_chat_streams_through_the_proxy(deployment):
    client = openai.OpenAI(base_url=deployment["proxy"][0] + "/v1", api_key="none")
    direct = openai.OpenAI(base_url=deployment["decode"][0] + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Describe the sea in a few words. " * 3}]
    kw = dict(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(
        (c.choices[0].delta.content or "") + (getattr(c.choices[0].delta, "reasoning_content", None) or "")
        for c in chunks
        if c.choices
    )
    plain = direct.chat.completions.create(**kw).choices[0].message  # the decode instance alone: local
    assert streamed == (plain.content or "") + (getattr(plain, "reasoning_content", None) or "")
    assert chunks[-1].choices[0].finish_reason == "length"
    assert state(deployment["decode"][0])["handoffs"] >= 1


def test_decode_side_joint_hit_skips_the_prefill(deployment):
    """With --disagg-local-prefill-tokens, a follow-up turn whose history the decode instance
    holds with a KDA checkpoint (its end-of-turn state) is finished there: no prefill, no transfer."""
    ckpt, ref, p_url = deployment["ckpt"], deployment["ref"], deployment["prefill"][0]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with instance(ckpt, "decode", "--disagg-local-prefill-tokens", "48") as (d_url, _, handoff):
        with proxy([p_url], [d_url]) as (x_url, _):
            client = openai.OpenAI(base_url=x_url + "/v1", api_key="none")
            prompt = list(range(300, 370))
            for turn in range(2):
                want = ref.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0]
                got = client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
                )
                assert got.choices[0].text == want.text
                prompt = prompt + list(want.token_ids) + list(range(700, 712))
        assert handoff.counters["handoffs"] == 1 and handoff.counters["local_prefills"] == 1
        assert handoff.counters["local_hit_tokens"] >= 96
        idle_and_clean(d_url)


def test_concurrent_requests_hand_off_in_parallel(deployment):
    """More requests at once than the decode instance has live slots: reservations queue on its
    engine thread for slots, prefills and reads interleave; each answer is still the colocated one, every prompt
    was handed off (none computed on the decode side) and both sides end clean."""
    import concurrent.futures

    ref, x_url, d_url = deployment["ref"], deployment["proxy"][0], deployment["decode"][0]
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 1700) for _ in range(40 + 17 * i)] for i in range(5)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in ref.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    before = state(d_url)
    assert ENGINE["max_num_seqs"] < len(prompts)

    def ask(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        return httpx.post(x_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        got = list(pool.map(ask, prompts))
    assert got == want
    after = state(d_url)
    assert after["handoffs"] == before.get("handoffs", 0) + 5
    assert after.get("reserve_waits", 0) > before.get("reserve_waits", 0)  # a reservation queued for a slot
    idle_and_clean(deployment["prefill"][0])
    idle_and_clean(d_url)
