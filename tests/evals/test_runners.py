"""`deltaserve eval`'s two ways in agree: the same checkpoint answers the same held-out samples
identically through the offline engine and through a live server (fp32, greedy, both thinking
modes; the server's K3 channel guard off, as the offline engine has none), and the command prints a
score per task and mode."""

from __future__ import annotations

import json

import pytest

from deltaserve.cli import main
from deltaserve.evals.runner import EvalPath, OfflineRunner, ServerRunner
from deltaserve.tiny import make_tiny
from deltaserve.train.curriculum import eval_set
from tests.server.live_server import live_server


@pytest.mark.parametrize("thinking", [True, False])
def test_server_and_offline_answers_agree(tmp_path_factory, thinking):
    samples = eval_set("greet", 2, 3) + eval_set("arithmetic", 2, 3)
    ckpt = make_tiny(tmp_path_factory.mktemp("same"), family="kimi_k3", preset="tiny", seed=0)
    offline = OfflineRunner(ckpt, EvalPath(dtype="float32", max_tokens=24))
    try:
        want = offline.run(samples, thinking)
    finally:
        offline.close()
    with live_server(tmp_path_factory, "m", {"channel_guard": False}, max_model_len=1024) as srv:
        server = ServerRunner(srv["url"], max_tokens=24)
        try:
            got = server.run(samples, thinking)
        finally:
            server.close()
    assert [a.key() for a in got] == [a.key() for a in want]
    assert all(a.finish_reason for a in got) and any(a.content or a.reasoning for a in got)


def test_eval_command_prints_a_score_per_task_and_mode(tmp_path, capsys):
    ckpt = make_tiny(tmp_path / "m", family="kimi_k3", preset="tiny", seed=0)
    argv = ["eval", str(ckpt), "--tasks", "greet,recall", "-n", "1", "--dtype", "float32", "--json"]
    assert main([*argv, "--prefix-cache", "--recall-min", "200", "--recall-max", "300", "--max-tokens", "4"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["tasks"]) == {f"{t}/{m}" for t in ("greet", "recall") for m in ("think", "no-think")}
    assert report["prefix_cache_hits"] > 0
    with pytest.raises(SystemExit):
        main(["eval", str(ckpt), "--tasks", "nope"])


def test_eval_preempt_sizes_each_tasks_budget_to_its_longest_request(tmp_path, capsys):
    """--preempt gives every task an engine whose KV budget fits its longest request once, so
    short tasks are preempted too (a fixed recall-sized budget held all arithmetic requests)."""
    ckpt = make_tiny(tmp_path / "m", family="kimi_k3", preset="tiny", seed=0)
    argv = ["eval", str(ckpt), "--tasks", "arithmetic", "-n", "6", "--thinking", "off", "--json", "--preempt"]
    assert main([*argv, "--dtype", "float32", "--max-tokens", "48"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["tasks"]) == {"arithmetic/no-think"} and report["preemptions"] > 0
