"""Handoffs between tensor-parallel instances: a TP2 prefill instance (its own process and
worker) and a TP2 decode instance (this process and a worker) give the colocated one-process
engine's greedy answer; the prefill instance sent every byte of the one-process state once (the
MLA rows to rank 0 alone, which shares them with rank 1; half the KDA heads to each rank), also
for an n = 2 request whose second sample forks the received cache on both ranks; a later turn
hits the decode side's prefix cache; a bad digest or an unreachable session on rank 1 alone fails the handoff closed
(recomputed, counted) and the ranks go on; instances of other tensor-parallel sizes hand off
(TP1 prefill -> TP2 decode and TP2 -> TP1: the KDA heads re-sliced in head blocks, each checked
by its own digest) and give the same answer; a prefill instance over two nodes (loopback) hands
off with each node's ranks at that node's own address; both sides end with clean pools."""

from __future__ import annotations

import os
import signal

import httpx
import msgspec
import pytest

from deltaserve.engine.request.sampling_params import SamplingParams
from tests.server.live_server import wait_healthy

from .pd_fixtures import SECRET, free_port, idle_and_clean, instance, make_llm, need_mooncake, spawn, tp_checkpoint
from .test_pd_serving import expected_bytes

need_mooncake()

GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)
FIRST = [(13 * i) % 1500 + 20 for i in range(70)]
SECOND = FIRST + [(7 * i) % 900 + 50 for i in range(41)]
THIRD = [(11 * i) % 1300 + 30 for i in range(53)]
FOURTH = FIRST[:40]
PROMPTS = (FIRST, SECOND, THIRD, FOURTH)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tp_checkpoint(tmp_path_factory.mktemp("pdtp"))


@pytest.fixture(scope="module")
def want(ckpt) -> dict[int, str]:
    llm = make_llm(ckpt)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY))
    return {len(p): o.outputs[0].text for p, o in zip(PROMPTS, outs)}


@pytest.fixture(scope="module")
def prefill_tp2(ckpt):
    port = free_port()
    proc = spawn(ckpt, "prefill", port, "--tensor-parallel-size", "2")
    try:
        wait_healthy(proc, port, 300)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def decode_tp2(ckpt):
    with instance(ckpt, "decode", tensor_parallel_size=2) as d:
        yield d


def _complete(decode_url: str, prefill_url: str, prompt: list[int]) -> str:
    headers = {"X-Deltaserve-Secret": SECRET, "X-Deltaserve-Prefill": prefill_url}
    body = {"model": "tiny", "prompt": prompt, **GREEDY}
    r = httpx.post(decode_url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_rank_instances_hand_off_what_one_process_computes(ckpt, want, prefill_tp2, decode_tp2):
    d_url, _, handoff = decode_tp2
    assert handoff.ranks.world == 2 and len({e.session for e in handoff.ranks.endpoints}) == 2
    c = handoff.counters
    assert _complete(d_url, prefill_tp2, FIRST) == want[len(FIRST)]
    assert c["handoffs"] == 1 and c["failures"] == 0 and c["hits"] == 0
    mla, kda = expected_bytes(ckpt, len(FIRST) - 1)
    assert (c["bytes_mla"], c["bytes_kda"]) == (mla, kda)  # MLA rows once, KDA heads split
    assert c["bytes_mla_shared"] == mla  # rank 1 took them from rank 0
    # the next turn: the decode side's prefix cache holds the first turn's pages
    assert _complete(d_url, prefill_tp2, SECOND) == want[len(SECOND)]
    assert c["handoffs"] == 2 and c["hits"] == 1 and c["hit_tokens"] > 0
    idle_and_clean(d_url)
    idle_and_clean(prefill_tp2)


def test_n2_forks_on_every_rank(want, prefill_tp2, decode_tp2):
    d_url, _, handoff = decode_tp2
    before = dict(handoff.counters)
    headers = {"X-Deltaserve-Secret": SECRET, "X-Deltaserve-Prefill": prefill_tp2}
    body = {"model": "tiny", "prompt": THIRD, **GREEDY, "n": 2}
    r = httpx.post(d_url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert [ch["text"] for ch in r.json()["choices"]] == [want[len(THIRD)]] * 2
    c = handoff.counters
    assert c["handoffs"] == before["handoffs"] + 1 and c["forks"] == before.get("forks", 0) + 1
    assert c["failures"] == before.get("failures", 0)
    idle_and_clean(d_url)
    idle_and_clean(prefill_tp2)


def _on_rank1(**fields):
    def hook(stage, obj):
        if stage != "header":
            return obj
        ranks = list(obj.ranks)
        if fields.get("digests") == "zeros":
            fields["digests"] = {k: "0" * 32 for k in ranks[1].digests}
        ranks[1] = msgspec.structs.replace(ranks[1], **fields)
        return msgspec.structs.replace(obj, ranks=ranks)

    return hook


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(digests="zeros"), "failed_checksum_mismatch"),
        (dict(session="127.0.0.1:9"), "failed_TransferError"),
    ],
)
def test_a_bad_share_on_one_rank_fails_the_handoff_closed(want, prefill_tp2, decode_tp2, fields, reason):
    d_url, _, handoff = decode_tp2
    before = dict(handoff.counters)
    handoff.tamper = _on_rank1(**fields)
    try:
        assert _complete(d_url, prefill_tp2, THIRD) == want[len(THIRD)]
    finally:
        handoff.tamper = None
    c = handoff.counters
    assert c[reason] == before.get(reason, 0) + 1
    assert c["recomputes"] == before.get("recomputes", 0) + 1 and c["handoffs"] == before["handoffs"]
    idle_and_clean(d_url)
    # the ranks went on: a clean handoff of a fresh prompt still runs and matches
    assert _complete(d_url, prefill_tp2, FOURTH) == want[len(FOURTH)]
    assert c["handoffs"] == before["handoffs"] + 1
    idle_and_clean(d_url)
    idle_and_clean(prefill_tp2)


def _headers(handoff) -> list:
    seen = []

    def hook(stage, obj):
        if stage == "header":
            seen.append(obj)
        return obj

    handoff.tamper = hook
    return seen


def test_a_tp1_prefill_hands_off_to_a_tp2_decode(ckpt, want, decode_tp2):
    d_url, _, handoff = decode_tp2
    before = dict(handoff.counters)
    headers = _headers(handoff)
    try:
        with instance(ckpt, "prefill") as (p_url, _, _):
            assert _complete(d_url, p_url, THIRD) == want[len(THIRD)]
            idle_and_clean(p_url)
    finally:
        handoff.tamper = None
    c = handoff.counters
    assert c["handoffs"] == before["handoffs"] + 1 and c["failures"] == before.get("failures", 0)
    assert len(headers[0].ranks) == 1 and headers[0].blocks == 2  # one rank's heads in two blocks
    assert sorted(k for k in headers[0].ranks[0].digests if k.startswith("kda/0/")) == ["kda/0/0", "kda/0/1"]
    idle_and_clean(d_url)


def test_a_tp2_prefill_hands_off_to_a_tp1_decode(ckpt, want, prefill_tp2):
    with instance(ckpt, "decode") as (d_url, _, handoff):
        assert _complete(d_url, prefill_tp2, FOURTH) == want[len(FOURTH)]
        c = handoff.counters
        assert c["handoffs"] == 1 and c["failures"] == 0 and c["recomputes"] == 0, dict(c)
        mla, kda = expected_bytes(ckpt, len(FOURTH) - 1)
        assert (c["bytes_mla"], c["bytes_kda"]) == (mla, kda)  # each head block once, from the rank holding it
        idle_and_clean(d_url)
    idle_and_clean(prefill_tp2)


def test_a_prefill_instance_over_two_nodes(ckpt, want, decode_tp2):
    d_url, _, handoff = decode_tp2
    port, init = free_port(), free_port()
    multi = ["--tensor-parallel-size", "2", "--nnodes", "2", "--distributed-init-method", f"tcp://127.0.0.1:{init}"]
    node1 = spawn(ckpt, "prefill", free_port(), *multi, "--node-rank", "1", "--kv-transfer-host", "127.0.0.2")
    node0 = spawn(ckpt, "prefill", port, *multi, "--node-rank", "0")
    headers = []

    def seen(stage, obj):
        if stage == "header":
            headers.append(obj)
        return obj

    try:
        wait_healthy(node0, port, 300)
        before = dict(handoff.counters)
        handoff.tamper = seen
        assert _complete(d_url, f"http://127.0.0.1:{port}", THIRD) == want[len(THIRD)]
        assert [r.session.split(":")[0] for r in headers[0].ranks] == ["127.0.0.1", "127.0.0.2"]
        assert handoff.counters["handoffs"] == before["handoffs"] + 1
        assert handoff.counters["failures"] == before.get("failures", 0)
        idle_and_clean(d_url)
        idle_and_clean(f"http://127.0.0.1:{port}")
    finally:
        handoff.tamper = None
        for proc in (node0, node1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
