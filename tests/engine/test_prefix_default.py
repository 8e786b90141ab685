"""Prefix caching is on by default (as vLLM's) in `LLM(...)`, `deltaserve generate` and
`deltaserve serve`; `enable_prefix_caching=False` / `--no-enable-prefix-caching` opts out."""

import argparse
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deltaserve import LLM, SamplingParams, serve
from deltaserve.cli import _add_generate, main
from deltaserve.engine.config import EngineConfig
from deltaserve.replica_front import replica_argv
from deltaserve.tiny import make_tiny
from tests.server.live_server import wait_healthy

PROMPT = list(range(10, 110))  # 100 tokens: one 64-token match unit can hit
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=0)


def _twice(llm: LLM) -> dict:
    for _ in range(2):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    return llm.stats()


def test_llm_caches_prefixes_unless_opted_out(ckpt):
    kw = dict(dtype="float32", max_model_len=256, progress=False)
    on = LLM(ckpt, **kw)
    assert on.config.enable_prefix_caching and on.layout.num_checkpoint_slots > 0
    stats = _twice(on)["prefix_cache"]
    assert stats["hits"] == 1 and stats["hit_tokens"] == 64, stats
    off = LLM(ckpt, enable_prefix_caching=False, **kw)
    assert off.layout.num_checkpoint_slots == 0 and "prefix_cache" not in _twice(off)


def test_command_line_defaults_and_opt_out():
    for command in ("serve", "generate"):
        p = argparse.ArgumentParser()
        sub = p.add_subparsers()
        serve.add_arguments(sub.add_parser("serve"))
        _add_generate(sub)
        base = [command] + ([] if command == "serve" else ["--model", "m", "--prompt", "x"])
        for extra, want in (([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)):
            args = p.parse_args(base + extra)
            assert EngineConfig.from_args(args, model="m").enable_prefix_caching is want, (command, extra)


def test_generate_command_hits_with_no_flags(ckpt, capsys):
    prompt = "The same long prompt, " * 8  # well over one 64-token unit
    argv = ["generate", "--model", str(ckpt), "--max-tokens", "2", "--max-model-len", "512", "--dtype", "float32"]
    assert main(argv + ["--prompt", prompt, "--prompt", prompt]) == 0
    hits = re.search(r"'prefix_cache': \{[^}]*'hits': (\d+)", capsys.readouterr().out)
    assert hits is not None and int(hits.group(1)) >= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hits(port: int, model: str) -> float | None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    for _ in range(2):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    m = re.search(r"^deltaserve:prefix_cache_hits(?:_total)?(?:\{[^}]*\})? (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_serve_with_no_flags_caches_prefixes(ckpt):
    """Two `deltaserve serve CKPT` processes, one with no engine flag, one opting out."""
    procs = {}
    try:
        for extra in ((), ("--no-enable-prefix-caching",)):
            port = _free_port()
            cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(ckpt), "--port", str(port), *extra]
            procs[extra] = (port, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for port, proc in procs.values():
            wait_healthy(proc, port, 180)
        name = Path(ckpt).resolve().name
        assert _hits(procs[()][0], name) == 1
        assert not _hits(procs[("--no-enable-prefix-caching",)][0], name)
    finally:
        for _, proc in procs.values():
            proc.kill()
            proc.wait()


def test_data_parallel_replicas_get_the_opt_out():
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    for flags, want in (([], True), (["--no-enable-prefix-caching"], False)):
        argv = replica_argv(p.parse_args(flags), p, "m")
        assert p.parse_args(argv[1:]).enable_prefix_caching is want, argv
