"""A decode instance counts every request it computes itself instead of taking its prompt by handoff,
by reason, in `/metrics` (`deltaserve:pd_bypass_total{reason}`) and `/disagg/state`: a
one-token prompt, no prefill instance named (or named without the shared secret), a request it
refuses, a handoff that fails before any transfer (an unreachable prefill instance). Nothing here
reaches a transfer, so the instance runs without a transfer engine (a stand-in for its ranks); a
handoff that runs counts none (`test_pd_serving`); n > 1 and images no longer go around the
handoff (`test_pd_cluster`)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from deltaserve.chat.render import load_chat_template
from deltaserve.disagg.decode import bypass_reason
from deltaserve.disagg.service import BYPASS_REASONS
from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.roles import install_role
from deltaserve.server.app import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.tiny import make_tiny
from tests.server.live_server import run_app

from .pd_fixtures import SECRET, make_llm, role_args, state

parser = pytest.importorskip("prometheus_client.parser")
NOWHERE = "http://127.0.0.1:9"  # never contacted: each request below bypasses before any handoff


@pytest.fixture(scope="module")
def decode_url(tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("pdb") / "k3", "kimi_k3", "tiny", seed=4)
    llm = make_llm(ckpt)
    engine = AsyncEngine(llm.engine, llm.model.config.family, load_chat_template(ckpt))
    try:
        app = build_app(engine, "tiny")
        install_role(app, engine, role_args("decode"), ranks=SimpleNamespace(world=1, endpoints=[]))
        with run_app(app) as url:
            yield url
    finally:
        engine.shutdown()
        llm.shutdown()


def _complete(url: str, prompt: list[int], headers: dict, status: int = 200, **extra) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == status, r.text


def _bypasses(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        s.labels["reason"]: s.value
        for fam in parser.text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "deltaserve:pd_bypass_total"
    }


def test_requests_around_the_handoff_are_counted_by_reason(decode_url):
    target = {"X-Deltaserve-Secret": SECRET, "X-Deltaserve-Prefill": NOWHERE}
    assert _bypasses(decode_url) == dict.fromkeys(BYPASS_REASONS, 0.0)
    _complete(decode_url, [42], target)
    _complete(decode_url, list(range(30, 60)), {})
    _complete(decode_url, list(range(30, 60)), {"X-Deltaserve-Secret": "wrong", "X-Deltaserve-Prefill": NOWHERE})
    want = dict.fromkeys(BYPASS_REASONS, 0.0) | {"short_prompt": 1.0, "no_prefill_target": 2.0}
    assert _bypasses(decode_url) == want
    s = state(decode_url)
    assert (s["bypass_short_prompt"], s["bypass_no_prefill_target"]) == (1, 2)
    assert "handoffs" not in s and "failures" not in s


def test_refused_and_failed_handoffs_are_counted(decode_url):
    target = {"X-Deltaserve-Secret": SECRET, "X-Deltaserve-Prefill": NOWHERE}
    before = _bypasses(decode_url)
    _complete(decode_url, [5] * 1100, target, status=400)  # over max_model_len: refused here
    _complete(decode_url, list(range(30, 60)), target)  # the prefill instance is unreachable: recomputed
    after = _bypasses(decode_url)
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {"invalid": 1, "handoff_failed": 1}
    assert state(decode_url)["failures"] == 1
    _complete(decode_url, list(range(30, 60)), target, n=2)  # n > 1 tries the handoff too
    assert _bypasses(decode_url)["handoff_failed"] == after["handoff_failed"] + 1


def test_bypass_reason_names_the_first_that_applies():
    one, two = SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, n=2)
    assert bypass_reason(None, [1, 2], two, ["img"]) == "no_prefill_target"
    assert bypass_reason(NOWHERE, [1, 2], two, ["img"]) is None  # images and n > 1 hand off
    assert bypass_reason(NOWHERE, [1], one, None) == "short_prompt"
    assert bypass_reason(NOWHERE, [1, 2], one, None) is None


def test_only_a_prompt_ending_inside_an_image_stays_local():
    from deltaserve.disagg.images import last_in_image

    span = ((5, 10, b"digest"),)  # an image's pad run at positions 5..9
    assert last_in_image(10, span) and last_in_image(6, span)
    assert not last_in_image(11, span) and not last_in_image(5, span) and not last_in_image(11, ())
