"""`deltaserve serve --data-parallel-size 2`: two replica servers behind one front. The official
openai client works through it (plain and streamed); requests that share a prompt prefix land on
the same replica (where it is cached: its prefix cache hits), different prompts spread over both;
killing a replica turns `/ready` 503 and the front exits 1, taking the other replica with it; a
front killed outright (SIGKILL: no cleanup of its own) takes its replica servers along too."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from deltaserve.tiny import make_tiny
from tests.server.live_server import ready_codes_until_exit, wait_healthy


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routed(base: str) -> list[int]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = dict(re.findall(r'deltaserve:dp_requests_total\{replica="(\d)"\} (\d+)', text))
    return [int(found[str(i)]) for i in range(2)]


def _hits(base: str, i: int) -> float:
    text = httpx.get(f"{base}/replicas/{i}/metrics", timeout=10).text
    m = re.search(r"^deltaserve:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _children(proc: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def _kill_all(proc: subprocess.Popen, replicas: list[int]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for p in replicas:
        subprocess.run(["kill", "-9", str(p)], capture_output=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dp") / "k3", family="kimi_k3", preset="tiny", seed=3)


def test_two_replicas_behind_one_front(model):
    port = _port()
    cmd = [
        sys.executable,
        "-m",
        "deltaserve.cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
    ]
    cmd += ["--threads", "1", "--max-model-len", "1024", "--enable-prefix-caching", "--prefix-match-unit", "16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    replicas: list[int] = []
    try:
        wait_healthy(proc, port, 180)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        replicas = _children(proc)
        assert len(replicas) == 2
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        assert client.models.list().data[0].id == "k3"
        for i in range(8):  # different prompts spread over both replicas
            out = client.completions.create(model="k3", prompt=f"prompt number {i} " * 3, max_tokens=2)
            assert out.usage.completion_tokens == 2
        spread = _routed(base)
        assert sum(spread) == 8 and min(spread) > 0, spread
        system = {"role": "system", "content": "You are a careful assistant. " * 20}
        first = {"role": "user", "content": "Tell me about the sea."}
        for turn in range(3):  # one conversation: its prefix stays on one replica
            msgs = [system, first, {"role": "assistant", "content": "It is wide."}] if turn else [system, first]
            msgs.append({"role": "user", "content": f"and then {turn}?"})
            stream = client.chat.completions.create(model="k3", messages=msgs, max_tokens=3, stream=True)
            assert sum(1 for c in stream if c.choices and c.choices[0].delta.content is not None) >= 1
        after = _routed(base)
        moved = [a - b for a, b in zip(after, spread)]
        assert sorted(moved) == [0, 3], moved
        home = moved.index(3)
        assert _hits(base, home) > 0 and _hits(base, 1 - home) == 0
        os.kill(replicas[home], signal.SIGKILL)
        codes = ready_codes_until_exit(proc, base)
        rc = proc.wait(10)
        assert 503 in codes and rc == 1, (codes, rc, proc.stdout.read()[-2000:])
        time.sleep(0.5)
        assert all(subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode for p in replicas)
    finally:
        _kill_all(proc, replicas)


def test_replica_servers_do_not_outlive_a_killed_front(model):
    port = _port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(model), "--port", str(port)]
    cmd += ["--data-parallel-size", "2", "--threads", "1", "--max-model-len", "256"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    replicas: list[int] = []
    try:
        wait_healthy(proc, port, 180)
        replicas = _children(proc)
        assert len(replicas) == 2
        proc.kill()
        proc.wait(10)
        deadline = time.time() + 15
        alive = replicas
        while alive and time.time() < deadline:
            time.sleep(0.25)
            alive = [p for p in replicas if subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode == 0]
        assert not alive, f"replica servers {alive} outlived the front"
    finally:
        _kill_all(proc, replicas)
