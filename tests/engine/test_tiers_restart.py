"""Kill -9 a `deltaserve serve` with a disk tier and restart it on the same --kv-disk-path: the
next turn of the session restores its prefix from disk (the metric counts it) and answers as the
cache off does."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

from deltaserve import LLM, SamplingParams
from deltaserve.tiny import make_tiny

from ..server.live_server import wait_healthy


def metric(base: str, name: str, tier: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    m = re.search(rf'^deltaserve:{name}{{[^}}]*tier="{tier}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def start(ckpt, disk, port: int) -> subprocess.Popen:
    flags = ["--port", str(port), "--dtype", "float32", "--threads", "1", "--page-size", "4"]
    flags += ["--prefix-match-unit", "8", "--max-model-len", "256", "--kv-disk-path", str(disk)]
    flags += ["--kv-disk-size", "64MiB", "--kv-cache-memory", str(16 << 20)]
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(ckpt), *flags]
    return subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def complete(base: str, ids: list[int]) -> str:
    body = {"model": "m", "prompt": ids, "max_tokens": 6, "temperature": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_sigkill_and_restart_resume_from_disk(tmp_path):
    ckpt = make_tiny(tmp_path / "m", family="kimi_k3", preset="tiny", seed=21)
    off = LLM(ckpt, dtype="float32", max_model_len=256, enable_prefix_caching=False, progress=False)
    rng = random.Random(4)
    vocab = off.model.config.vocab_size
    first = [rng.randrange(vocab) for _ in range(90)]
    second = first + [rng.randrange(vocab) for _ in range(20)]
    want = [off.generate([p], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0] for p in (first, second)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    disk = tmp_path / "kv"
    proc = start(ckpt, disk, port)
    try:
        wait_healthy(proc, port, 120)
        assert complete(base, first) == want[0].outputs[0].text
        deadline = time.time() + 30
        while metric(base, "prefix_cache_tier_objects", "disk") < 1:
            assert time.time() < deadline, "the disk tier wrote nothing"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc = start(ckpt, disk, port)
        wait_healthy(proc, port, 120)
        assert complete(base, second) == want[1].outputs[0].text
        assert metric(base, "prefix_cache_tier_hits_total", "disk") == 1
        assert metric(base, "prefix_cache_tier_hit_tokens_total", "disk") == 88
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
