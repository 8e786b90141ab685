"""`LLM(..., data_parallel_size=2)`: a client of two engine replica processes gives exactly what
one engine does (greedy tokens, logprobs within float32 noise, seeded samples, chat with an
image), spreads a batch over both replicas, keeps a shared prefix on one, refuses a bad batch
whole, also over tensor-parallel replicas; a replica that dies fails only its requests
(`ReplicaFailure`, with the others' outputs) and the rest serve on; replicas exit with the
client's process; the protocol round-trips its types."""

from __future__ import annotations

import _thread
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from deltaserve.cli import build_parser
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.dp.client import ReplicaFailure, replica_configs, visible_gpus
from deltaserve.engine.dp.protocol import (
    Link,
    Outputs,
    ToClient,
    image_from_wire,
    image_to_wire,
    params_from_wire,
    params_to_wire,
)
from deltaserve.engine.dp.routing import pick, rendezvous, token_key
from deltaserve.engine.request.multimodal import image_input
from deltaserve.engine.request.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.engine.request.structured import Special, StructuredOutput
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.tiny import PRESETS, make_tiny

from .engine_fixtures import WIDE, make_llm

GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
SEEDED = SamplingParams(n=2, max_tokens=8, temperature=0.9, top_k=50, seed=1234, logprobs=0)
KW = dict(skip_tokenizer_init=False, enable_prefix_caching=True, max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as m:
        m.setitem(PRESETS, ("kimi_k3", "tp"), dataclasses.replace(PRESETS[("kimi_k3", "tiny")], **WIDE))
        return make_tiny(tmp_path_factory.mktemp("dp") / "k3", "kimi_k3", "tp", seed=7)


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (112, 84, 3), dtype=np.uint8))


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 1800 + 40 for i in range(n)]


def batch(ckpt: Path) -> tuple[list, list]:
    """Short and long token prompts, a text prompt, two sharing a prefix, one with an image."""
    tok, proc = Tokenizer.from_pretrained(ckpt), ImageProcessor.from_pretrained(ckpt)
    im = image_input(picture(3), proc)
    shared = ids(9, 70)
    prompts = [ids(1, 5), ids(2, 300), "Hello there", shared + [5], shared + [6, 7], ids(3, 17)]
    prompts.append(
        {"prompt_token_ids": ids(4, 6) + im.image.prompt_ids(tok) + ids(5, 4), "multi_modal_data": {"image": im}}
    )
    params = [GREEDY, GREEDY, GREEDY, GREEDY, SEEDED, SEEDED, GREEDY]
    return prompts, params


CONVERSATION = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "what is this?"}, {"type": "image_pil", "image_pil": picture(5)}],
    }
]


def tokens_and_logprobs(outs) -> tuple[list, torch.Tensor]:
    toks = [c.token_ids for o in outs for c in o.outputs]
    lps = [lp[t].logprob for o in outs for c in o.outputs for lp, t in zip(c.logprobs, c.token_ids)]
    return toks, torch.tensor(lps)


def added(llm) -> list[int]:
    return [s["requests_added"] for s in llm.stats()["replicas"]]


@pytest.fixture(scope="module")
def one(ckpt):
    with make_llm(ckpt, **KW) as llm:
        yield llm


@pytest.fixture(scope="module")
def two(ckpt):
    """Two replicas; `test_a_replica_that_dies_fails_only_its_requests` (last) kills one."""
    with make_llm(ckpt, data_parallel_size=2, **KW) as llm:
        yield llm


def test_two_replicas_generate_what_one_engine_does(ckpt, one, two):
    prompts, params = batch(ckpt)
    want = one.generate(prompts, params, use_tqdm=False)
    before = added(two)
    got = two.generate(prompts, params, use_tqdm=False)
    per_replica = [a - b for a, b in zip(added(two), before)]
    assert min(per_replica) > 0 and sum(per_replica) == len(prompts)  # both replicas worked
    assert [o.request_id for o in got] == [o.request_id for o in want]
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    (want_t, want_lp), (got_t, got_lp) = tokens_and_logprobs(want), tokens_and_logprobs(got)
    assert got_t == want_t and got[2].outputs[0].text == want[2].outputs[0].text
    assert (got_lp - want_lp).abs().max() <= 1e-5 * max(1.0, want_lp.abs().max().item())
    want_chat = one.chat(CONVERSATION, GREEDY, use_tqdm=False)[0]
    assert two.chat(CONVERSATION, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want_chat.outputs[0].token_ids


def test_requests_sharing_a_prefix_meet_on_one_replica(two):
    before = added(two)  # three prompts sharing their first prefix_match_unit (64) tokens
    base = ids(11, 64)
    two.generate([base + [1], base + [2, 3], base + [4] * 5], GREEDY, use_tqdm=False)
    assert sorted(a - b for a, b in zip(added(two), before)) == [0, 3]


def _replica_stats(llm) -> list[dict]:
    return [
        {"added": s["requests_added"], "computed": s["computed_tokens"], **s["prefix_cache"]}
        for s in llm.stats()["replicas"]
    ]


def test_a_request_goes_where_its_long_prefix_resumes(two):
    """Six prompts sharing their first unit: the sixth spills to the other replica (`SPILL`), with
    a 4-unit prefix of its own. A later request sharing that long prefix goes there (the replicas
    published it), not to the first unit's rendezvous replica: it hits 256 tokens there and the
    other replica computes nothing for it. Routing by the first unit's hash alone sent it home.
    Once every replica evicted its checkpoints (and said so), it goes home again."""
    head, tail = ids(21, 64), ids(22, 192)
    two.generate([head + ids(30 + i, 70) for i in range(5)] + [head + tail + [9]], GREEDY, use_tqdm=False)
    before = _replica_stats(two)
    two.generate([head + tail + [5, 6, 7]], GREEDY, use_tqdm=False)
    after = _replica_stats(two)
    went = [a["added"] - b["added"] for a, b in zip(after, before)]
    held = went.index(1)
    assert sorted(went) == [0, 1]
    assert after[held]["hits"] == before[held]["hits"] + 1
    assert after[held]["hit_tokens"] - before[held]["hit_tokens"] == 256
    assert after[1 - held]["computed"] == before[1 - held]["computed"]
    assert two.stats()["routing"]["resume_device"] >= 1
    assert two._dp.router.index.count(held) > 0
    assert two.reset_prefix_cache()  # every checkpoint evicted: the replicas said so
    assert two._dp.router.index.held == {}
    before = _replica_stats(two)
    two.generate([head + tail + [5, 6, 7]], GREEDY, use_tqdm=False)  # nothing resumes: the first unit's home
    went = [a["added"] - b["added"] for a, b in zip(_replica_stats(two), before)]
    assert went[1 - held] == 1 and two.stats()["routing"]["hash"] >= 1


def test_a_refused_batch_leaves_nothing_queued_and_the_rest_works(one, two):
    bad = [ids(1, 4), ids(2, 2000), [1, 2, "x"]]
    with pytest.raises(InvalidRequestError) as want:
        one.generate(bad, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError) as got:
        two.generate(bad, GREEDY, use_tqdm=False)
    assert str(got.value) == str(want.value)
    with pytest.raises(InvalidRequestError, match="must be ints"):
        two.generate([ids(1, 4), [1, 2, "x"]], GREEDY, use_tqdm=False)
    stats = two.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["data_parallel_size"] == 2
    assert stats["requests_added"] == sum(s["requests_added"] for s in stats["replicas"])
    assert len(two.rank_memory) == 2 and two.rank_memory[0]["weight_bytes"] > 0
    assert two.model is None and two.max_model_len == 1024
    two.check_integrity()
    assert two.reset_prefix_cache()
    with pytest.raises(NotImplementedError):
        two.pool_snapshot()
    assert len(two.generate(ids(5, 9), GREEDY, use_tqdm=False)) == 1


def test_an_interrupted_call_aborts_its_requests_and_the_replicas_go_on(two):
    for r in two._dp.replicas:  # a terminal's Ctrl-C reaches the replicas too: they ignore it
        os.kill(r.proc.pid, signal.SIGINT)
    aborted = two.stats()["requests_aborted"]
    # the call decodes to max_model_len (~1000 steps, well under a second on the native kernels):
    # the interrupt comes early in it, through Python's own Ctrl-C handler (interrupt_main does
    # nothing where the handler is SIG_IGN, as in a pytest started in the background by a shell)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.1, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            two.generate([ids(1, 8), ids(2, 8)], SamplingParams(max_tokens=3000, ignore_eos=True), use_tqdm=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    stats = two.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["requests_aborted"] == aborted + 2
    assert all(r.proc.poll() is None for r in two._dp.replicas)
    assert len(two.generate(ids(5, 9), GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_a_replica_that_dies_fails_only_its_requests(one, two):
    """SIGKILL replica 1 mid-batch: the call raises `ReplicaFailure` naming it, with the other
    replica's outputs whole; replica 0 lives on and later calls run there, as one engine would."""
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    victim = two._dp.replicas[1].proc
    threading.Timer(1.0, victim.kill).start()
    with pytest.raises(ReplicaFailure, match=r"replica 1 failed: pid \d+ .*-9.*requests were on it") as failure:
        two.generate([ids(1, 8), ids(4, 8), ids(5, 8)], long, use_tqdm=False)  # on 1, 0, 0
    outs = failure.value.outputs
    assert failure.value.replica == 1 and len(outs) == 3 and None in outs
    done = [o for o in outs if o is not None]
    assert done and all(len(o.outputs[0].token_ids) == 300 for o in done)  # replica 0's finished
    assert two._dp.replicas[0].proc.poll() is None and victim.poll() == -signal.SIGKILL
    prompts = [ids(5, 9), ids(6, 70), ids(7, 12)]
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)] == want
    stats = two.stats()
    assert stats["replicas_live"] == 1 and stats["data_parallel_size"] == 2 and len(stats["replicas"]) == 1
    assert two._dp.router.index.count(1) == 0  # what the dead replica published is forgotten
    two.shutdown()
    assert all(r.proc.poll() is not None for r in two._dp.replicas)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


CLIENT = """
import json, os, sys
from pathlib import Path
from deltaserve.engine.request.sampling_params import SamplingParams
from tests.parallel.engine_fixtures import make_llm
prompts = json.loads(sys.argv[2])
llm = make_llm(sys.argv[1], tp=2, data_parallel_size=2, enable_prefix_caching=False)  # routed by load
outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
replicas = [r.proc.pid for r in llm._dp.replicas]
ranks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) in replicas]
tokens = [o.outputs[0].token_ids for o in outs]
print(json.dumps(dict(tokens=tokens, pids=replicas + ranks, added=llm.stats()["replicas"])))
sys.stdout.flush()
os._exit(0)
"""
PPID = """
def _ppid(p):
    try:
        return int(p.joinpath("stat").read_text().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
"""


def test_tensor_parallel_replicas_and_their_ranks_exit_with_the_client(ckpt, one):
    """DP2 x TP2 (a client, two replicas, a worker rank each) in a child process that exits
    without shutting down: the tokens are one engine's, and every process it started exits."""
    prompts = [ids(i, 9 + 13 * i) for i in range(4)]
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-c", PPID + CLIENT, str(ckpt), json.dumps(prompts)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=root, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] == want
    assert min(s["requests_added"] for s in report["added"]) > 0
    assert len(report["pids"]) == 4  # two replicas, each with one worker rank
    deadline = time.monotonic() + 15
    while any(map(_alive, report["pids"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, report["pids"]))


def test_sampling_params_and_outputs_round_trip():
    p = SamplingParams(
        n=2,
        stop=["x"],
        stop_token_ids=[3],
        logprobs=2,
        seed=-5,
        structured=StructuredOutput.json({"type": "object"}, prefix=(Special("<|close|>"), "a")),
        keep_special_token_ids=[7, 2],
        thinking_token_budget=4,
        reasoning_end=(Special("<|close|>"), "a"),
    )
    assert params_from_wire(params_to_wire(p)) == p
    assert params_from_wire(params_to_wire(SamplingParams())) == SamplingParams()
    a, b = socket.socketpair()
    tx, rx = Link(a, ToClient), Link(b, ToClient)
    out = RequestOutput(
        "7", "hi", [1, 2], [CompletionOutput(0, "t", [5], -0.5, [{5: Logprob(-0.5, 1, "t")}], "stop", 9)], True
    )
    tx.send(Outputs([out]))
    assert rx.ready(5) and rx.recv() == Outputs([out])
    a.close()
    with pytest.raises(EOFError):
        rx.recv()
    b.close()


def test_image_round_trip(ckpt):
    im = image_input(picture(2), ImageProcessor.from_pretrained(ckpt))
    back = image_from_wire(image_to_wire(im))
    assert back.digest == im.digest and torch.equal(back.image.pixel_values, im.image.pixel_values)
    assert (back.image.grid_thw, back.image.num_tokens, back.image.image_size) == (
        im.image.grid_thw,
        im.image.num_tokens,
        im.image.image_size,
    )


def test_routing_is_prefix_affine_and_load_bounded():
    key = token_key(list(range(100)), None, 64)
    assert key == token_key(list(range(64)) + [999], None, 64) != token_key(list(range(100)), "salt", 64)
    home = rendezvous(key, 3)
    assert all(rendezvous(key, 3) == home for _ in range(3)) and 0 <= home < 3
    loads = [0, 0, 0]
    assert pick(key, loads, spill=4) == home
    loads[home] = 5
    assert pick(key, loads, spill=4) != home and pick(key, [0, 0, 0], spill=0) == home
    assert pick(key, [3 if i == home else 0 for i in range(3)], spill=0) != home


def test_config_and_cli(tmp_path):
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(model="x", data_parallel_size=0)
    with pytest.raises(ValueError, match="nnodes"):
        EngineConfig(model="x", data_parallel_size=2, nnodes=2, tensor_parallel_size=2).check_parallel()
    c = EngineConfig(model="x", data_parallel_size=2, tensor_parallel_size=2, num_threads=None)
    reps = replica_configs(c)
    inits = [r.distributed_init_method for r in reps]
    assert len(set(inits)) == 2 and all(r.data_parallel_size == 1 and r.num_threads >= 1 for r in reps)
    disk = EngineConfig(model="x", data_parallel_size=2, kv_disk_path=str(tmp_path / "tiers"))
    assert [r.kv_disk_path for r in replica_configs(disk)] == [str(tmp_path / "tiers" / f"replica-{i}") for i in (0, 1)]
    given = dataclasses.replace(c, distributed_init_method="tcp://127.0.0.1:29500")
    assert [r.distributed_init_method for r in replica_configs(given)] == [
        "tcp://127.0.0.1:29500",
        "tcp://127.0.0.1:29501",
    ]
    args = build_parser().parse_args(
        ["generate", "--model", str(tmp_path), "--prompt", "a", "--data-parallel-size", "2"]
    )
    assert EngineConfig.from_args(args, data_parallel_size=args.data_parallel_size).data_parallel_size == 2


def test_each_replica_gets_its_own_gpus_when_there_are_enough(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    c = EngineConfig(model="x", device="cuda", tensor_parallel_size=2, data_parallel_size=2)
    assert [visible_gpus(c, i, 2) for i in range(2)] == ["0,1", "2,3"]
    assert visible_gpus(c, 0, 3) is None  # 6 GPUs needed: the replicas share
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert [visible_gpus(dataclasses.replace(c, tensor_parallel_size=1), i, 2) for i in range(2)] == ["5", "7"]
    assert visible_gpus(dataclasses.replace(c, device="cpu"), 0, 2) is None
