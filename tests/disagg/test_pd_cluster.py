"""Disaggregation as a cluster runs it: the prefill instance's checkpoint at one path and the
decode instance's copy at another (as on two hosts) hand off with no recompute, because the model
identity in every fingerprint is the checkpoint's content, not its path; an image request (the
prefill instance encodes the pixels the decode instance sends) and an n = 2 request (the second
sample forks the received cache) go through the handoff and answer what the decode instance
computes alone (a salted request: no cache shared)."""

from __future__ import annotations

import base64
import io
import shutil

import httpx
import pytest

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.tiny import make_tiny

from .pd_fixtures import SECRET, idle_and_clean, instance, make_llm, need_mooncake

need_mooncake()

GREEDY = dict(max_tokens=5, temperature=0, ignore_eos=True)
PROMPT = [(17 * i) % 1400 + 25 for i in range(45)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pdc") / "k3", "kimi_k3", "tiny", seed=8)


def complete(decode_url: str, prefill_url: str, prompt, **extra) -> dict:
    headers = {"X-Deltaserve-Secret": SECRET, "X-Deltaserve-Prefill": prefill_url}
    body = {"model": "tiny", "prompt": prompt, **GREEDY, **extra}
    r = httpx.post(decode_url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_copy_at_another_path_hands_off(ckpt, tmp_path):
    copy = shutil.copytree(ckpt, tmp_path / "host-b" / "weights")
    want = make_llm(ckpt).generate([{"prompt_token_ids": PROMPT}], SamplingParams(**GREEDY))[0].outputs[0].text
    with instance(ckpt, "prefill") as (p_url, _, _), instance(copy, "decode") as (d_url, _, handoff):
        assert complete(d_url, p_url, PROMPT)["choices"][0]["text"] == want
        c = handoff.counters
        assert c["handoffs"] == 1 and c["recomputes"] == 0 and c["failures"] == 0, dict(c)
        assert not handoff.bypasses
        idle_and_clean(d_url)
        idle_and_clean(p_url)


@pytest.fixture(scope="module")
def pair(ckpt):
    with instance(ckpt, "prefill") as p, instance(ckpt, "decode") as d:
        yield p[0], d[0], d[2]


def picture_url(seed: int, w: int = 56, h: int = 84) -> str:
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_image_request_goes_through_the_handoff(pair):
    p_url, d_url, handoff = pair
    content = [
        {"type": "text", "text": "What is in this picture? Say it in a few words, please."},
        {"type": "image_url", "image_url": {"url": picture_url(3)}},
        {"type": "text", "text": "Answer briefly."},
    ]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], **GREEDY}
    headers = {"X-Deltaserve-Secret": SECRET, "X-Deltaserve-Prefill": p_url}
    before = dict(handoff.counters)
    r = httpx.post(d_url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    c = handoff.counters
    assert c["handoffs"] == before.get("handoffs", 0) + 1 and c["image_handoffs"] == before.get("image_handoffs", 0) + 1
    assert c["failures"] == before.get("failures", 0) and not handoff.bypasses
    alone = httpx.post(d_url + "/v1/chat/completions", json=body | {"cache_salt": "alone"}, timeout=300)
    assert r.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
    assert c["handoffs"] == before.get("handoffs", 0) + 1  # the salted request ran here
    idle_and_clean(d_url)
    idle_and_clean(p_url)


def test_an_n2_request_forks_after_the_handoff(pair):
    p_url, d_url, handoff = pair
    prompt = [(29 * i) % 1500 + 40 for i in range(37)]  # the last prompt token mid-page: a page copy
    sampled = dict(n=2, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    before = dict(handoff.counters)
    got = complete(d_url, p_url, prompt, **sampled)
    c = handoff.counters
    assert c["handoffs"] == before.get("handoffs", 0) + 1 and c["forks"] == before.get("forks", 0) + 1
    assert c["failures"] == before.get("failures", 0) and not handoff.bypasses
    body = {"model": "tiny", "prompt": prompt, **GREEDY, **sampled, "cache_salt": "alone"}
    alone = httpx.post(d_url + "/v1/completions", json=body, timeout=300).json()
    texts = [ch["text"] for ch in sorted(got["choices"], key=lambda ch: ch["index"])]
    assert texts == [ch["text"] for ch in sorted(alone["choices"], key=lambda ch: ch["index"])]
    assert texts[0] != texts[1]  # two samples, each from its own copy of the cache
    idle_and_clean(d_url)
    idle_and_clean(p_url)
