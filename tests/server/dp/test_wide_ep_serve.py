"""`deltaserve serve --data-parallel-size 2 --enable-expert-parallel`: two replica servers, each
one rank of a wide expert-parallel group (half the routed experts each, all-to-all in lock-step).
Greedy completions equal the one-process engine's; each replica's /metrics shows the token load
of its own experts (0-3 on one, 4-7 on the other) and its lock-step rounds; a request on one
replica makes the other run zero-token forwards; stopping the front stops both. The same with TP 2
inside each replica server (its worker rank holding half the replica's experts)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.tiny import make_tiny
from tests.server.dp.test_data_parallel import _children, _drain, _kill_all, _port, _routed
from tests.server.live_server import wait_healthy

PROMPTS = ["the sea is wide and", "numbers: one two", "hello there, how", "a b c d e f"]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("wide_ep") / "k3", family="kimi_k3", preset="tiny", seed=3)


def _counters(text: str, name: str) -> dict[str, float]:
    """`deltaserve:{name}_total` samples by their last label's value (or "" unlabelled)."""
    pattern = rf'^deltaserve:{name}_total(?:\{{[^}}]*?(?:expert="(\d+)")?[^}}]*\}})? (\S+)$'
    return {label: float(v) for label, v in re.findall(pattern, text, re.M)}


@pytest.mark.parametrize("tp", [1, 2])
def test_wide_ep_replica_servers(model, tp):
    with LLM(model, "float32", num_threads=1, max_model_len=1024, progress=False) as one:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        want = [o.outputs[0].text for o in one.generate(PROMPTS, params, use_tqdm=False)]
    port = _port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(model), "--port", str(port)]
    cmd += ["--data-parallel-size", "2", "--enable-expert-parallel", "--dtype", "float32", "--threads", "1"]
    cmd += ["--max-model-len", "1024", "--no-enable-prefix-caching", "--served-model-name", "k3"]
    cmd += ["--tensor-parallel-size", str(tp)]  # at TP 2: 4 ranks, 2 experts each, 4 a replica
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    replicas: list[int] = []
    try:
        wait_healthy(proc, port, 240)
        _drain(proc)
        base = f"http://127.0.0.1:{port}"
        replicas = _children(proc)
        assert len(replicas) == 2
        body = {"model": "k3", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        first = httpx.post(f"{base}/v1/completions", json=body | {"prompt": PROMPTS[0]}, timeout=120).json()
        assert first["choices"][0]["text"] == want[0]
        home = _routed(base).index(1)
        idle = _counters(httpx.get(f"{base}/replicas/{1 - home}/metrics", timeout=10).text, "ep_idle_forwards")
        assert idle[""] >= MAX_TOKENS  # one zero-token forward per step of the busy replica
        for prompt, text in zip(PROMPTS[1:], want[1:]):
            got = httpx.post(f"{base}/v1/completions", json=body | {"prompt": prompt}, timeout=120).json()
            assert got["choices"][0]["text"] == text
        assert min(_routed(base)) > 0  # both replicas served requests
        held = []
        for i in range(2):
            text = httpx.get(f"{base}/replicas/{i}/metrics", timeout=10).text
            load = _counters(text, "expert_tokens")
            held.append(sorted(int(e) for e in load))
            assert sum(load.values()) > 0 and _counters(text, "ep_rounds")[""] > 0
        assert sorted(held) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        _kill_all(proc, replicas + _children(proc))
