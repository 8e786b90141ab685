"""The proxy sends a request's prefill to the prefill instance where its prefix resumes: with two
prefill instances, one of which (the second: the least-loaded rule picked the first) computed a
prompt before, a request extending that prompt is prefilled there, hitting its prefix cache,
while the other computes nothing; the decision is counted, and the answer is the colocated one."""

from __future__ import annotations

import httpx

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.tiny import make_tiny

from .pd_fixtures import instance, make_llm, need_mooncake, proxy, state

need_mooncake()


def _hit_tokens(engine) -> int:
    return engine.call_sync(lambda core: core.cache.prefix_stats()["hit_tokens"])


def test_the_prefill_goes_where_the_prefix_resumes(tmp_path):
    ckpt = make_tiny(tmp_path / "k3", "kimi_k3", "tiny", seed=5)
    first = [(7 * i) % 1600 + 20 for i in range(70)]
    follow = first + [(11 * i) % 1600 + 20 for i in range(30)]
    with (
        instance(ckpt, "prefill") as (p0, e0, _),
        instance(ckpt, "prefill") as (p1, e1, _),
        instance(ckpt, "decode") as (d, _, _),
        proxy([p0, p1], [d]) as (url, px),
    ):
        body = {"model": "tiny", "prompt": first, "max_tokens": 1, "temperature": 0}
        assert httpx.post(p1 + "/v1/completions", json=body, timeout=120).status_code == 200  # p1 holds it
        hits0, hits1 = _hit_tokens(e0), _hit_tokens(e1)
        body = {"model": "tiny", "prompt": follow, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        got = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 200, got.text
        assert state(p1).get("prefills") == 1 and state(p0).get("prefills", 0) == 0
        assert _hit_tokens(e1) - hits1 >= 64 and _hit_tokens(e0) == hits0
        assert px.counters["prefill_routed_resume_device"] == 1 and px.counters["prefill_joint_hit_tokens"] >= 64
        greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        want = make_llm(ckpt).generate([{"prompt_token_ids": follow}], greedy)[0].outputs[0]
        assert got.json()["choices"][0]["text"] == want.text and len(want.token_ids) == 4
