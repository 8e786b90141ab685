"""Fail-closed handoffs: a corrupted byte, a stale generation, a wrong fingerprint, a prefill
instance killed mid-transfer and a decode instance killed under the proxy each give the
colocated answer (recomputed on the decode side) or a clear error, never other tokens, and
leave no pages, slots or parked prompts behind on either side."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import torch

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.tiny import make_tiny
from tests.server.live_server import wait_healthy

from .pd_fixtures import SECRET, free_port, idle_and_clean, instance, make_llm, need_mooncake, proxy, spawn, state

need_mooncake()

PROMPT = list(range(40, 140))
GREEDY = dict(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pdf") / "k3", "kimi_k3", "tiny", seed=9)


@pytest.fixture(scope="module")
def want(ckpt) -> str:
    return make_llm(ckpt).generate([{"prompt_token_ids": PROMPT}], SamplingParams(**GREEDY))[0].outputs[0].text


@pytest.fixture(scope="module")
def pair(ckpt):
    with instance(ckpt, "prefill", "--disagg-park-timeout", "1") as p, instance(ckpt, "decode") as d:
        yield p, d


def _complete(decode_url: str, prefill_url: str, prompt=PROMPT) -> httpx.Response:
    headers = {"X-Deltaserve-Secret": SECRET, "X-Deltaserve-Prefill": prefill_url}
    body = {"model": "tiny", "prompt": prompt, **GREEDY}
    return httpx.post(decode_url + "/v1/completions", json=body, headers=headers, timeout=120)


def _corrupt(cache):
    def hook(stage, obj):
        if stage == "received":  # a flipped byte in the first received MLA row
            cache.mla.storage.view(-1).view(torch.uint8)[obj.regions[0].offset + 3] ^= 0x40
        return obj

    return hook


def _tampered(**fields):
    def hook(stage, obj):
        return msgspec.structs.replace(obj, **fields) if stage == "header" else obj

    return hook


@pytest.mark.parametrize(
    "name, hook, reason",
    [
        ("corrupt", "corrupt", "failed_checksum_mismatch"),
        ("stale", _tampered(generation=10**9), "failed_stale_generation"),
        ("fingerprint", _tampered(fingerprint="0" * 64), "failed_fingerprint_mismatch"),
        ("prefix", _tampered(prefix_hash="f" * 64), "failed_prefix_mismatch"),
        ("other_request", _tampered(request_id="another"), "failed_header_mismatch"),
    ],
)
def test_a_bad_handoff_is_recomputed(pair, want, name, hook, reason):
    (p_url, _, _), (d_url, _, handoff) = pair
    before = dict(handoff.counters)
    handoff.tamper = _corrupt(handoff.cache) if hook == "corrupt" else hook
    try:
        r = _complete(d_url, p_url)
    finally:
        handoff.tamper = None
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    assert handoff.counters[reason] == before.get(reason, 0) + 1
    assert handoff.counters["recomputes"] == before.get("recomputes", 0) + 1
    assert handoff.counters["handoffs"] == before.get("handoffs", 0)  # nothing accepted
    idle_and_clean(d_url)
    time.sleep(2.5)  # a stale release leaves the prefill side's copy to its park timeout
    idle_and_clean(p_url)


def test_error_mode_refuses_instead(ckpt, pair, want):
    (p_url, _, _), _ = pair
    with instance(ckpt, "decode", "--disagg-on-failure", "error") as (d_url, _, handoff):
        handoff.tamper = _tampered(fingerprint="0" * 64)
        r = _complete(d_url, p_url)
        assert r.status_code == 502 and "fingerprint_mismatch" in r.json()["error"]["message"]
        handoff.tamper = None
        assert _complete(d_url, p_url).json()["choices"][0]["text"] == want
        idle_and_clean(d_url)
    time.sleep(2.5)
    idle_and_clean(p_url)


def test_internal_routes_need_the_secret(pair):
    (p_url, _, _), (d_url, _, handoff) = pair
    assert httpx.post(p_url + "/disagg/prefill", content=b"\x80", timeout=10).status_code == 401
    assert httpx.get(d_url + "/disagg/state", headers={"X-Deltaserve-Secret": "wrong"}).status_code == 401
    before = dict(handoff.counters)
    r = httpx.post(  # a prefill header without the secret is ignored: served locally
        d_url + "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, **GREEDY},
        headers={"X-Deltaserve-Prefill": "http://127.0.0.1:9"},
        timeout=60,
    )
    assert r.status_code == 200 and dict(handoff.counters) == before


def test_a_prefill_instance_killed_mid_transfer(ckpt, want):
    port = free_port()
    proc = spawn(ckpt, "prefill", port)
    try:
        wait_healthy(proc, port, 180)
        with instance(ckpt, "decode") as (d_url, _, handoff):

            def kill_after_header(stage, obj):
                if stage == "header":  # the prefill side answered: it dies before the read
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)
                return obj

            handoff.tamper = kill_after_header
            r = _complete(d_url, f"http://127.0.0.1:{port}")
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            assert handoff.counters["recomputes"] == 1 and handoff.counters["handoffs"] == 0
            handoff.tamper = None
            r = _complete(d_url, f"http://127.0.0.1:{port}")  # the peer is gone for good: same answer
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            idle_and_clean(d_url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_decode_instance_killed_under_the_proxy(ckpt, pair, want):
    (p_url, _, _), (d_url, _, _) = pair
    port = free_port()
    proc = spawn(ckpt, "decode", port)
    try:
        wait_healthy(proc, port, 180)
        dead = f"http://127.0.0.1:{port}"
        with proxy([p_url], [dead]) as (x_url, _):
            body = {"model": "tiny", "prompt": PROMPT, **GREEDY}
            assert httpx.post(x_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == want
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            r = httpx.post(x_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 503 and "decode instance" in r.json()["error"]["message"]
        with proxy([p_url], [dead, d_url]) as (x_url, _):  # a live one takes over
            r = httpx.post(x_url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            assert httpx.get(x_url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"
            assert httpx.get(x_url + "/ready", timeout=30).status_code == 503  # one instance is down
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # a decode instance that died after its prefill: the parked prompt is freed at the timeout
    msg = msgspec.msgpack.encode({"request_id": "x", "token_ids": PROMPT[:-1], "start": 0})
    r = httpx.post(p_url + "/disagg/prefill", content=msg, headers={"X-Deltaserve-Secret": SECRET}, timeout=60)
    assert r.status_code == 200 and state(p_url)["transfers_parked"] == 1
    time.sleep(2.5)
    assert idle_and_clean(p_url)["transfers_parked"] == 0


def test_a_refused_request_moves_nothing(pair):
    (p_url, _, _), (d_url, _, handoff) = pair
    before, prefills = dict(handoff.counters), state(p_url).get("prefills", 0)
    r = _complete(d_url, p_url, prompt=list(range(10, 1100)))  # over max_model_len: refused before any handoff
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert handoff.counters["handoffs"] == before.get("handoffs", 0)
    assert state(p_url).get("prefills", 0) == prefills  # the prefill side was not asked
    idle_and_clean(d_url)


def test_a_peer_that_is_no_prefill_instance(pair, want):
    """The named prefill URL answers, but not as a prefill instance (here: the decode instance
    itself, which has no /disagg/prefill): recomputed, counted, pools clean."""
    _, (d_url, _, handoff) = pair
    before = dict(handoff.counters)
    r = _complete(d_url, d_url)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert handoff.counters["failed_prefill_refused"] == before.get("failed_prefill_refused", 0) + 1
    idle_and_clean(d_url)


def test_the_proxy_exits_cleanly_on_sigterm():
    port = free_port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "proxy", "--port", str(port), "--disagg-secret", SECRET]
    cmd += ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503  # no instance up
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
