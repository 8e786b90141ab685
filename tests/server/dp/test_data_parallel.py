"""`deltaserve serve --data-parallel-size 2`: two replica servers behind one front. The official
openai client works through it (plain and streamed); requests that share a prompt prefix land on
the same replica (where it is cached: its prefix cache hits), different prompts spread over both;
a replica killed (SIGKILL) fails only its in-flight requests, naming its death, while the front
serves on the other and restarts it; a front killed outright (SIGKILL: no cleanup of its own) takes
its replica servers along too; a front none of whose replicas comes up in time exits 1."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from deltaserve.tiny import make_tiny
from tests.server.live_server import wait_healthy


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
        output = _drain(proc)  # the front's and its replicas' log: a full pipe would block their writes
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
        survives_a_replica_death(proc, base, client, home, [system, first], replicas, output)
    finally:
        _kill_all(proc, replicas + _children(proc))


def _metric(base: str, name: str) -> float:
    m = re.search(rf"^deltaserve:{name} (\S+)$", httpx.get(f"{base}/metrics", timeout=10).text, re.M)
    return float(m.group(1))


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return got


def _drain(proc: subprocess.Popen) -> list[str]:
    """The lines `proc` writes, read on a daemon thread as they come."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return lines


def survives_a_replica_death(proc, base: str, client, home: int, prefix: list, pids: list, output: list) -> None:
    """SIGKILL replica `home` with a plain and a streamed request in flight on it (`prefix` routes
    there): both fail naming its death, the next requests succeed on the other replica, the killed
    one comes back (a new process) and serves again; with none live the front answers 503."""
    body = {"model": "k3", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
    body["messages"] = [*prefix, {"role": "user", "content": "go on"}]
    plain: dict = {}
    url = f"{base}/v1/chat/completions"
    thread = threading.Thread(target=lambda: plain.update(r=httpx.post(url, json=body, timeout=120)))
    thread.start()
    sent = f'deltaserve:dp_requests_inflight{{replica="{home}"}} 1'
    _until(lambda: sent in httpx.get(f"{base}/metrics", timeout=10).text, 30, "the request did not go out")
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # both are running on `home`
        os.kill(pids[home], signal.SIGKILL)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert httpx.get(f"{base}/ready", timeout=10).json()["live"] == 1
    exited = f'deltaserve:dp_replica_failures_total{{replica="{home}",reason="exited"}} 1'
    _until(lambda: exited in httpx.get(f"{base}/metrics", timeout=10).text, 30, "".join(output[-40:]))
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and f"replica {home} died (killed by SIGKILL)" in error["message"], events[-3:]
    thread.join(60)
    assert plain["r"].status_code == 502 and f"replica {home} died" in plain["r"].json()["error"]["message"]
    for i in range(4):  # routed to the live replica, whatever their prefix
        out = client.completions.create(model="k3", prompt=f"after the death {i}", max_tokens=2)
        assert out.usage.completion_tokens == 2
    assert proc.poll() is None
    _until(lambda: _metric(base, "dp_replicas_live") == 2, 120, "the killed replica did not come back")
    text = httpx.get(f"{base}/metrics", timeout=10).text
    restarts = re.search(rf'^deltaserve:dp_replica_restarts_total{{replica="{home}"}} (\d+)', text, re.M)
    exited = re.search(rf'^deltaserve:dp_replica_failures_total{{replica="{home}",reason="exited"}} (\d+)', text, re.M)
    # one restart per exit (a loaded machine may see a restarted replica fail once more)
    assert int(restarts.group(1)) >= 1 and int(restarts.group(1)) == int(exited.group(1)), text
    assert pids[home] not in _children(proc) and len(_children(proc)) == 2
    routed = _routed(base)[home]
    back = client.chat.completions.create(model="k3", messages=body["messages"], max_tokens=2)
    assert back.usage.completion_tokens == 2 and _routed(base)[home] == routed + 1  # its prefix is home again
    for pid in _children(proc):
        os.kill(pid, signal.SIGKILL)
    _until(lambda: _metric(base, "dp_replicas_live") == 0, 30, "the front did not notice")
    down = httpx.post(f"{base}/v1/completions", json={"model": "k3", "prompt": "x", "max_tokens": 1})
    assert down.status_code == 503 and "(0 of 2 live; they are being restarted)" in down.json()["error"]["message"]
    assert httpx.get(f"{base}/ready", timeout=10).status_code == 503 and proc.poll() is None


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


def test_a_front_none_of_whose_replicas_comes_up_exits_1(model):
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(model), "--port", str(_port())]
    cmd += ["--data-parallel-size", "2", "--threads", "1", "--replica-start-timeout", "0.5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "come up" in line]
    want = r"ERROR \S+: no data-parallel replica came up: replica 0 \(pid \d+\) did not come up within 0.5 s; "
    assert len(said) == 1 and re.fullmatch(want + r"replica 1 \(pid \d+\) did not come up within 0.5 s", said[0]), said
    assert "Traceback" not in done.stderr
