"""Start-up failures of `serve --role` and `proxy` end the process with status 1 and one line
naming the cause, never a traceback (before the fix: the transfer engine's error escaped `serve`
as a traceback, and the proxy's secret or instance list as another)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deltaserve.tiny import make_tiny

ENGINE = ["--dtype", "float32", "--threads", "1", "--max-model-len", "256"]


def _run(args: list[str], env: dict, processes: list) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, **env),
    )
    processes.append(p)
    return p


def _one_line_failure(p: subprocess.Popen, want: str) -> str:
    _, err = p.communicate(timeout=240)
    assert p.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "did not start" in line]
    assert len(lines) == 1 and want in lines[0], err[-3000:]
    return lines[0]


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_role_and_proxy_start_up_failures_are_one_line_and_exit_1(tmp_path, processes):
    ckpt = make_tiny(tmp_path / "kl", "kimi_linear", "tiny", seed=0)
    fake = tmp_path / "fake" / "mooncake"  # a transfer engine that cannot start, on any machine
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "engine.py").write_text("raise ImportError('no transfer engine in this test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    env["DELTASERVE_DISAGG_SECRET"] = "s"
    roles = {
        role: _run(["serve", str(ckpt), "--role", role, "--port", "0", *ENGINE], env, processes)
        for role in ("prefill", "decode")
    }
    bad_url = _run(["proxy", "--prefill", "localhost:1", "--decode", "http://127.0.0.1:2"], env, processes)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    no_secret = _run(
        ["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
        {"XDG_CACHE_HOME": str(not_a_dir), "DELTASERVE_DISAGG_SECRET": ""},
        processes,
    )
    for role, p in roles.items():
        line = _one_line_failure(p, f"--role {role} did not start: TransferError")
        assert "transfer engine" in line.lower()
    _one_line_failure(bad_url, "the proxy did not start: ValueError: an instance is an http:// or https:// URL")
    _one_line_failure(no_secret, "the proxy did not start: ")
