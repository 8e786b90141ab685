"""`/metrics` (Prometheus text) and the waiting-queue cap, on a real server with prefix caching."""

import threading
import time

import httpx
import pytest

from tests.server.live_server import live_server  # noqa: E402

parser = pytest.importorskip("prometheus_client.parser")


KEY = "sk-metrics"
MODEL = "tiny-k3-pc"
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(
        tmp_path_factory,
        MODEL,
        dict(api_key=KEY, max_waiting_requests=1),
        max_model_len=256,
        enable_prefix_caching=True,
        prefix_match_unit=16,
    ) as srv:
        yield srv


def post(server, body, path=CMPL):
    return httpx.post(server["url"] + path, json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"})


def scrape(server) -> dict:
    """{(sample name, frozenset(labels)): value} from /metrics."""
    r = httpx.get(server["url"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in parser.text_string_to_metric_families(r.text):
        assert fam.name.startswith("deltaserve:"), fam.name
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(m, name, **labels):
    labels = {"model_name": MODEL, **labels}
    return m.get((name, frozenset(labels.items())), 0.0)


def test_metrics_needs_key(server):
    assert httpx.get(server["url"] + "/metrics", timeout=30).status_code == 401


def test_counters_move_exactly(server):
    before = scrape(server)
    prompt = "Metrics are counted exactly"
    r = post(server, {"model": MODEL, "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "n": 2})
    assert r.status_code == 200
    usage = r.json()["usage"]
    n_prompt = len(server["tok"].encode(prompt))
    assert usage["prompt_tokens"] == n_prompt and usage["completion_tokens"] == 10
    after = scrape(server)

    def d(name, **kw):
        return val(after, name, **kw) - val(before, name, **kw)

    assert d("deltaserve:prompt_tokens_total") == n_prompt
    assert d("deltaserve:generation_tokens_total") == 10
    assert d("deltaserve:request_success_total", finished_reason="length") == 2
    assert d("deltaserve:time_to_first_token_seconds_count") == 2
    assert d("deltaserve:time_per_output_token_seconds_count") == 8
    assert d("deltaserve:e2e_request_latency_seconds_count") == 2
    assert d("deltaserve:e2e_request_latency_seconds_sum") > 0
    assert val(after, "deltaserve:num_requests_running") == 0
    assert val(after, "deltaserve:num_requests_waiting") == 0
    assert val(after, "deltaserve:mla_pages_used") == 0
    assert val(after, "deltaserve:mla_pages_total") > 0 and val(after, "deltaserve:kda_slots_total") > 0
    assert val(after, "deltaserve:kda_slots_used") == 0


def test_prefix_cache_hits(server):
    before = scrape(server)
    for name in (
        "queries",
        "hits",
        "hit_tokens",
        "retention_misses",
        "checkpoints_stored",
        "checkpoints_evicted",
        "restore_refused",
        "inflight_waits",
    ):
        assert ("deltaserve:prefix_cache_" + name + "_total", frozenset({("model_name", MODEL)})) in before
    assert val(before, "deltaserve:prefix_cache_checkpoint_slots_total") > 0
    shared = [(7 * i) % 500 + 3 for i in range(100)]
    for tail in ([11, 12, 13], [21, 22, 23]):
        r = post(server, {"model": MODEL, "prompt": shared + tail, "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
    after = scrape(server)
    assert (
        val(after, "deltaserve:prefix_cache_queries_total") - val(before, "deltaserve:prefix_cache_queries_total") >= 2
    )
    assert val(after, "deltaserve:prefix_cache_hits_total") - val(before, "deltaserve:prefix_cache_hits_total") > 0
    assert val(after, "deltaserve:prefix_cache_hit_tokens_total") > val(
        before, "deltaserve:prefix_cache_hit_tokens_total"
    )
    assert val(after, "deltaserve:prefix_cache_checkpoints_stored_total") > 0
    together = [(11 * i) % 700 + 5 for i in range(150)]  # two prompts sharing 150 tokens, one request
    r = post(server, {"model": MODEL, "prompt": [together + [1], together + [2, 3]], "max_tokens": 1})
    assert r.status_code == 200
    held = server["engine"].call_sync(lambda core: core.cache.prefix_stats()["inflight_waits"])
    assert val(scrape(server), "deltaserve:prefix_cache_inflight_waits_total") == held  # engaged: tests/engine


def test_refused_restores_are_counted(server):
    """States stored under another producer fingerprint are refused, counted and never used."""
    shared = [(5 * i) % 400 + 7 for i in range(64)]
    body = {"model": MODEL, "prompt": shared + [1, 2], "max_tokens": 2, "ignore_eos": True}
    assert post(server, body).status_code == 200
    before = scrape(server)
    engine = server["engine"]
    old = engine.call_sync(lambda c: c.cache.fingerprint)
    engine.call_sync(lambda c: setattr(c.cache, "fingerprint", b"another producer"))
    try:
        r = post(server, {**body, "prompt": shared + [3, 4]})
    finally:
        engine.call_sync(lambda c: setattr(c.cache, "fingerprint", old))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    after = scrape(server)
    name = "deltaserve:prefix_cache_restore_refused_total"
    assert val(after, name) - val(before, name) >= 1
    assert val(after, "deltaserve:prefix_cache_hits_total") == val(before, "deltaserve:prefix_cache_hits_total")


def test_queue_full_gets_429(server):
    engine = server["engine"]
    gate = threading.Event()
    blocked = engine._call(lambda core: gate.wait(30))  # park the engine thread between steps
    results = {}

    def first():
        results["a"] = post(server, {"model": MODEL, "prompt": "first", "max_tokens": 2})

    t = threading.Thread(target=first)
    try:
        t.start()
        deadline = time.time() + 20
        while engine.queue_load() < 1:  # A is on its way in: the cap (1) is reached
            assert time.time() < deadline
            time.sleep(0.01)
        for path, body in (
            (CMPL, {"model": MODEL, "prompt": "second", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
        ):
            r = post(server, body, path)
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "rate_limit_error"
    finally:
        gate.set()
        blocked.result(30)
        t.join(60)
    assert results["a"].status_code == 200
    assert val(scrape(server), "deltaserve:request_rejected_total") >= 2
    assert post(server, {"model": MODEL, "prompt": "after", "max_tokens": 2}).status_code == 200
