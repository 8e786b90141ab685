"""Launching a tensor-parallel engine: `deltaserve serve --tensor-parallel-size 2` answers the
official openai client, and when its worker is killed `/ready` turns 503 and the server exits 1
within seconds; a hung worker fails it within `--distributed-timeout`; two "nodes" on loopback
(the explicit --nnodes/--node-rank flags with expert parallelism, torchrun with decode context
parallelism) generate what one process does; the launch plan and the config refuse what cannot
work."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.exec.ranks import WORKER_ENV, plan_ranks, rank_device
from deltaserve.parallel.context import process_group_backend
from tests.server.live_server import ready_codes_until_exit, wait_healthy

from .engine_fixtures import write_checkpoints

PROMPT = "hello there"


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    return write_checkpoints(tmp_path_factory.mktemp("tp_launch"))["k3"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(x) for x in (task / "children").read_text().split()]
    return kids


ENGINE = ["--dtype", "float32", "--threads", "1", "--max-model-len", "512"]


def test_serve_tp2_answers_openai_then_fails_closed_when_a_worker_dies(k3, tmp_path):
    port = _port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(k3), "--port", str(port), "--tensor-parallel-size", "2"]
    proc = subprocess.Popen(cmd + ENGINE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port, 120)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        out = client.completions.create(model="k3", prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.usage.completion_tokens == 8
        chat = client.chat.completions.create(
            model="k3", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, temperature=0
        )
        assert chat.usage.completion_tokens == 6
        (worker,) = _children(proc.pid)
        t0 = time.time()
        os.kill(worker, signal.SIGKILL)
        codes = ready_codes_until_exit(proc, base)
        rc = proc.wait(5)
        elapsed = time.time() - t0
        log = proc.stdout.read()
        assert 503 in codes, codes
        assert rc == 1 and elapsed < 15, (rc, elapsed, log[-2000:])
        assert "worker rank 1" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_hung_worker_fails_the_engine_within_the_distributed_timeout(k3):
    port = _port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(k3), "--port", str(port), "--tensor-parallel-size", "2"]
    cmd += ENGINE + ["--distributed-timeout", "3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        wait_healthy(proc, port, 120)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        (worker,) = _children(proc.pid)
        os.kill(worker, signal.SIGSTOP)
        t0 = time.time()
        body = {"model": "k3", "prompt": PROMPT, "max_tokens": 4}
        status = httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code
        ready = httpx.get(f"{base}/ready", timeout=5).status_code if proc.poll() is None else None
        rc = proc.wait(20)
        assert status >= 500 and ready in (503, None), (status, ready)
        assert rc == 1 and time.time() - t0 < 20
        assert "tensor-parallel step failed" in proc.stdout.read()
    finally:
        if worker is not None:  # the server kills it on the way out; make sure
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _generate(k3: Path, *extra: str, launcher: list[str] | None = None, env: dict | None = None):
    args = ["generate", "--model", str(k3), "--prompt", PROMPT, "--max-tokens", "8", *ENGINE, *extra]
    cmd = (launcher or [sys.executable, "-m"]) + ["deltaserve.cli", *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **(env or {}))
    )


def _answer(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith(repr(PROMPT) + " -> ")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def test_two_nodes_on_loopback_generate_what_one_process_does(k3):
    one = _generate(k3)
    want = _answer(one.communicate(timeout=120)[0])
    port = _port()
    explicit = ["--tensor-parallel-size", "2", "--enable-expert-parallel", "--nnodes", "2"]
    explicit += ["--distributed-init-method", f"tcp://127.0.0.1:{port}"]
    nodes = [_generate(k3, *explicit, "--node-rank", str(r)) for r in (1, 0)]
    outs = [p.communicate(timeout=180)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert _answer(outs[1]) == want
    port = _port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [
        _generate(
            k3,
            "--tensor-parallel-size",
            "2",
            "--decode-context-parallel-size",
            "2",
            launcher=[*torchrun, "--node-rank", str(r), "-m"],
        )
        for r in (1, 0)
    ]
    outs = [p.communicate(timeout=180)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert _answer(outs[1]) == want


def test_launch_plan_and_config_refuse_what_cannot_work():
    cfg = EngineConfig("m", tensor_parallel_size=2)
    assert plan_ranks(EngineConfig("m"), {}) is None
    local = plan_ranks(cfg, {})
    assert (local.rank, local.spawn) == (0, (1,)) and local.init_method.startswith("tcp://127.0.0.1:")
    run = plan_ranks(cfg, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (run.rank, run.spawn, run.init_method) == (1, (), "env://")
    with pytest.raises(ValueError, match="torchrun started 4"):
        plan_ranks(cfg, {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="distributed-init-method"):
        plan_ranks(EngineConfig("m", tensor_parallel_size=4, nnodes=2, node_rank=1), {})
    node = plan_ranks(EngineConfig("m", tensor_parallel_size=4, nnodes=2, node_rank=1, distributed_init_method="x"), {})
    assert (node.rank, node.spawn) == (2, (3,))
    with pytest.raises(RuntimeError, match="worker"):
        plan_ranks(cfg, {WORKER_ENV: "{}"})
    for bad in (
        dict(tensor_parallel_size=2, decode_context_parallel_size=4),
        dict(tensor_parallel_size=3, nnodes=2),
        dict(node_rank=1),
    ):
        with pytest.raises(ValueError):
            plan_ranks(EngineConfig("m", **bad), {})
    with pytest.raises(ValueError):
        EngineConfig("m", tensor_parallel_size=0)


def test_each_cuda_rank_takes_the_gpu_of_its_local_rank(monkeypatch):
    """`rank_device` (no GPU needed: the CUDA calls are stood in for): one GPU per rank of a node,
    LOCAL_RANK under torchrun, made current before the group is joined; CPU and one-process
    configs pass through; an explicit GPU index with several ranks and too few GPUs refused."""
    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    two_nodes = EngineConfig("m", device="cuda", tensor_parallel_size=4, nnodes=2, node_rank=1)
    assert [rank_device(two_nodes, r, {}) for r in (2, 3)] == ["cuda:0", "cuda:1"] and current == [0, 1]
    assert rank_device(two_nodes, 3, {"LOCAL_RANK": "0"}) == "cuda:0"
    assert rank_device(EngineConfig("m", device="cpu", tensor_parallel_size=2), 1, {}) == "cpu"
    assert rank_device(EngineConfig("m", device="cuda:1"), 0, {}) == "cuda:1"
    with pytest.raises(ValueError, match="give --device cuda"):
        rank_device(EngineConfig("m", device="cuda:1", tensor_parallel_size=2), 1, {})
    with pytest.raises(ValueError, match="one GPU per rank"):
        rank_device(EngineConfig("m", device="cuda", tensor_parallel_size=4), 2, {})
    assert current == [0, 1, 0]


def test_cuda_groups_carry_host_tensors_over_gloo():
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"
