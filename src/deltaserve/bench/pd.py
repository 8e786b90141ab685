"""`deltaserve bench pd`: one multi-turn, branching workload served colocated (one instance)
and disaggregated (1 prefill + 1 decode instance behind `deltaserve proxy`), all on loopback.

Each configuration runs as separate `deltaserve` processes with the same model and engine
flags; sessions run one after another, each turn streamed, so TTFT and TPOT are per request.
It reports TTFT and TPOT for both, the bytes moved (MLA vs KDA state) and their rate over the
handoff time, the bytes read per decode instance with the MLA rows read once (shared over its
ranks) and as every rank reading them would, the prompt tokens the prefill side computed, and what the decode side's own
prefix cache saved: tokens it already held (not transferred) and prompts it finished itself.
Answers are compared (greedy text) between the two configurations: equal in float32 (a mismatch
fails the run); in bfloat16 the different chunking of the prompt's last token may round apart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

from ..env import DISAGG_SECRET
from .workload import WorkloadSpec, build_sessions

SECRET = "bench-pd-secret"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _processes(cmds: list[list[str]], ports: list[int]):
    env = dict(os.environ, **{DISAGG_SECRET.name: SECRET})
    procs = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
        for c in cmds
    ]
    try:
        for proc, port in zip(procs, ports):
            deadline = time.time() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"{proc.args} did not come up")
                time.sleep(0.2)
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _stream(base: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[str]]:
    """(TTFT, mean inter-token time, text pieces) of one streamed greedy completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    t0 = time.perf_counter()
    stamps, pieces = [], []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                stamps.append(time.perf_counter())
                pieces.append(choices[0]["text"])
    if not stamps:
        raise RuntimeError("the server streamed no tokens")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return stamps[0] - t0, tpot, pieces


def _run_workload(base: str, sessions, max_tokens: int, tokenize) -> dict:
    ttft, tpot, answers, prompts = [], [], [], []
    for sess in sessions:
        history = list(sess.history)
        for turn in sess.turns:
            prompt = history + turn
            prompts.append(prompt)
            t, p, pieces = _stream(base, prompt, max_tokens)
            ttft.append(t)
            tpot.append(p)
            answers.append("".join(pieces))
            history = prompt + tokenize("".join(pieces))
    return {"ttft": ttft, "tpot": tpot, "answers": answers, "prompts": prompts}


def _state(base: str) -> dict:
    return httpx.get(base + "/disagg/state", headers={"X-Deltaserve-Secret": SECRET}, timeout=30).json()


def read_bytes(ds: dict, world: int) -> str:
    """The bytes a decode instance read from prefill instances (its `/disagg/state` `ds`), with
    the MLA rows read once and shared over its `world` ranks (now), and as if every rank read
    them itself (before: the shared bytes came from the prefill instance too)."""
    after = ds.get("bytes_mla", 0) + ds.get("bytes_kda", 0)
    shared = ds.get("bytes_mla_shared", 0)
    return (
        f"bytes read per decode instance ({world} rank{'s' if world > 1 else ''}): {after} with the MLA rows "
        f"read once and shared over its ranks ({shared} copied rank to rank); {after + shared} with every rank "
        f"reading them from the prefill instance"
    )


def main(args: argparse.Namespace) -> int:
    from ..model.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model)
    spec = WorkloadSpec(
        sessions=args.sessions, rounds=args.rounds, system_tokens=args.system_tokens, tool_tokens=0, seed=args.seed
    )
    sessions = build_sessions(spec, tok.n_base, set(tok.special_ids))

    def tokenize(text: str) -> list[int]:
        return tok.encode(text)

    serve = [sys.executable, "-m", "deltaserve.cli", "serve", str(args.model), "--served-model-name", "bench"]
    serve += ["--dtype", args.dtype, "--threads", str(args.threads), "--enable-prefix-caching"]
    serve += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    c = _port()
    with _processes([serve + ["--port", str(c)]], [c]):
        colocated = _run_workload(f"http://127.0.0.1:{c}", sessions, args.max_tokens, tokenize)
    p, d, x = _port(), _port(), _port()
    proxy = [sys.executable, "-m", "deltaserve.cli", "proxy", "--port", str(x)]
    proxy += ["--prefill", f"http://127.0.0.1:{p}", "--decode", f"http://127.0.0.1:{d}"]
    decode = serve + [
        "--role",
        "decode",
        "--port",
        str(d),
        "--disagg-local-prefill-tokens",
        str(args.local_prefill_tokens),
    ]
    roles = [serve + ["--role", "prefill", "--port", str(p)], decode, proxy]
    with _processes(roles, [p, d, x]):
        pd = _run_workload(f"http://127.0.0.1:{x}", sessions, args.max_tokens, tokenize)
        ps, ds = _state(f"http://127.0.0.1:{p}"), _state(f"http://127.0.0.1:{d}")
    moved = ds.get("bytes_mla", 0) + ds.get("bytes_kda", 0)
    read_s, handoff_s = ds.get("read_us", 0) / 1e6, ds.get("transfer_us", 0) / 1e6
    print("config | requests | ttft_mean_s | ttft_p50_s | tpot_mean_s")
    for name, r in (("colocated", colocated), ("1P+1D", pd)):
        print(
            f"{name} | {len(r['ttft'])} | {statistics.mean(r['ttft']):.4f} | {statistics.median(r['ttft']):.4f} | "
            f"{statistics.mean(r['tpot']):.4f}"
        )
    same = sum(a == b for a, b in zip(colocated["answers"], pd["answers"]))
    note = " (bf16: the decode side computes the last prompt token alone, so rounding may differ)"
    print(f"greedy answers equal: {same}/{len(pd['answers'])}{note if args.dtype == 'bfloat16' else ''}")
    print(
        f"handoffs {ds.get('handoffs', 0)} | moved {moved / 1e9:.6f} GB (MLA {ds.get('bytes_mla', 0) / 1e9:.6f}, "
        f"KDA state {ds.get('bytes_kda', 0) / 1e9:.6f}) | {moved / 1e9 / read_s if read_s else 0:.3f} GB/s over "
        f"{read_s:.4f} s of reads; {handoff_s:.3f} s in handoffs (prefill wait and verification included)"
    )
    print(read_bytes(ds, args.tensor_parallel_size))
    prompts = sum(len(p) for p in colocated["prompts"])
    print(
        f"prompt tokens {prompts}: the prefill side computed {ps.get('computed_tokens', 0)} (its own prefix cache "
        f"held the rest); the decode side's cache held {ds.get('hit_tokens', 0)} not transferred "
        f"({ds.get('hits', 0)} hits) and it finished {ds.get('local_prefills', 0)} prompts itself; "
        f"recomputes {ds.get('recomputes', 0)}"
    )
    return 0 if same == len(pd["answers"]) or args.dtype == "bfloat16" else 1


def add_parser(sub) -> None:
    p = sub.add_parser("pd", help="multi-turn workload: colocated vs 1 prefill + 1 decode instance (loopback)")
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. make-tiny output)")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per instance (per rank)")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks of every instance (colocated, prefill, decode)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="the decode instance's --disagg-local-prefill-tokens (0: every prompt goes to the prefill side)",
    )
    p.set_defaults(func=main)
