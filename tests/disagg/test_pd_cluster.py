"""Disaggregation as a cluster runs it: the prefill instance's checkpoint at one path and the
decode instance's copy at another (as on two hosts) hand off with no recompute, because the model
identity in every fingerprint is the checkpoint's content, not its path."""

from __future__ import annotations

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
