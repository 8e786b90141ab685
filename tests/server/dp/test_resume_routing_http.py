"""`serve --data-parallel-size 2` routes on resumable prefixes: the replicas publish where a
prefix can resume (`/internal/cache_events`), and the front sends a request that extends an
earlier prompt to the replica holding it, even where the prompt start's rendezvous hash (the
routing before) names the other one; it hits there and the other replica receives nothing. A
named session (`prompt_cache_key`) stays on one replica across unrelated prompts. A killed
replica's entries are dropped from the front's index. Decisions are counted by reason."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from deltaserve.engine.dp.routing import rendezvous_among
from deltaserve.replica_front import routing_key
from deltaserve.tiny import make_tiny
from tests.server.dp.test_data_parallel import _children, _drain, _kill_all, _port, _routed, _until
from tests.server.live_server import wait_healthy


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dpr") / "k3", family="kimi_k3", preset="tiny", seed=3)


def _metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    m = re.search(rf"^deltaserve:{re.escape(name)}(?:{{{re.escape(labels)}}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _replica(base: str, i: int, name: str) -> float:
    text = httpx.get(f"{base}/replicas/{i}/metrics", timeout=10).text
    m = re.search(rf"^deltaserve:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(base: str, prompt: str, **extra) -> None:
    body = {"model": "k3", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 200


def _other_home(base_prompt: str, home: int) -> str:
    """A continuation of `base_prompt` whose prompt-start rendezvous replica is not `home`."""
    for j in range(64):
        prompt = f"{base_prompt} and then the follow-up number {j} arrives"
        if rendezvous_among(routing_key({"prompt": prompt}), [0, 1]) != home:
            return prompt
    raise AssertionError("no continuation hashes elsewhere")


@contextlib.contextmanager
def dp_front(model, *flags: str, start_s: float = 180):
    """`serve --data-parallel-size 2` with the prefix cache (unit 16) and `flags`, once both
    replicas' feeds answered (their first reply is a reset); yields (base URL, the output's
    lines, the replicas' pids). Kills all of it at the end."""
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(model), "--port", str(port := _port())]
    cmd += ["--data-parallel-size", "2", "--threads", "1", "--max-model-len", "1024"]
    cmd += ["--enable-prefix-caching", "--prefix-match-unit", "16", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pids: list[int] = []
    try:
        wait_healthy(proc, port, start_s)
        output = _drain(proc)
        base = f"http://127.0.0.1:{port}"
        pids = _children(proc)
        for i in range(2):
            _until(lambda i=i: _metric(base, "dp_route_event_batches_total", f'replica="{i}"') >= 1, 60, "no feed")
        yield base, output, pids
    finally:
        _kill_all(proc, pids + _children(proc))


def test_the_front_routes_where_the_prefix_resumes(model):
    with dp_front(model) as (base, output, pids):
        first = "You are a careful assistant who answers questions about the sea. " * 4 + "Why is it blue?"
        _complete(base, first)
        home = [i for i, n in enumerate(_routed(base)) if n][0]
        label = f'replica="{home}"'
        _until(lambda: _metric(base, "dp_route_boundaries", label) > 0, 30, "".join(output[-30:]))
        assert _metric(base, "dp_route_boundaries", f'replica="{1 - home}"') == 0
        second = _other_home(first, home)
        hits, other_prompt = (
            _replica(base, home, "prefix_cache_hit_tokens_total"),
            _replica(base, 1 - home, "prompt_tokens_total"),
        )
        _complete(base, second)
        assert _routed(base)[home] == 2  # where the prefix resumes, not the prompt start's hash
        assert _replica(base, home, "prefix_cache_hit_tokens_total") > hits
        assert _replica(base, 1 - home, "prompt_tokens_total") == other_prompt
        assert _metric(base, "dp_route_decisions_total", 'reason="resume_device"') >= 1
        a_session_stays_on_its_replica(base)
        kill_one(base, pids, home, output)


def a_session_stays_on_its_replica(base: str) -> None:
    """Unrelated prompts of one `prompt_cache_key` whose prompt-start hashes differ go to one replica."""
    prompts = [f"session prompt {j} about rivers" for j in range(16)]
    home = rendezvous_among(routing_key({"prompt": prompts[0]}), [0, 1])
    prompts = [prompts[0], next(p for p in prompts if rendezvous_among(routing_key({"prompt": p}), [0, 1]) != home)]
    before = _routed(base)
    for p in prompts:
        _complete(base, p, prompt_cache_key="agent-7")
    moved = [a - b for a, b in zip(_routed(base), before)]
    assert sorted(moved) == [0, 2], moved
    assert _metric(base, "dp_route_decisions_total", 'reason="affinity"') >= 1


def kill_one(base: str, pids: list[int], home: int, output: list[str]) -> None:
    """SIGKILL the replica holding the prefix: the front forgets what it published."""
    os.kill(pids[home], signal.SIGKILL)
    _until(lambda: _metric(base, "dp_route_boundaries", f'replica="{home}"') == 0, 30, "".join(output[-30:]))
