"""`DPClient`: the offline `LLM` with `data_parallel_size = N > 1`, a client of N engine
replicas (engine/dp/replica.py), as vLLM's `EngineCoreClient` is of its engine-core processes.

Each replica is a `python -m deltaserve.engine.dp.replica` subprocess with a whole engine (its
own scheduler, caches and, with `tensor_parallel_size > 1`, its own worker ranks on its own
rendezvous port); they load in parallel. With `enable_expert_parallel` (wide EP) every rank of
every replica joins one expert-parallel group instead (the routed experts split over all of them,
`data_parallel_rank` each replica, one rendezvous) and the replicas step in lock-step
(engine/core/lockstep.py). Each gets `num_threads` torch threads, by default the machine's cores
split evenly over every process of every replica, and on CUDA with enough GPUs its own
`tensor_parallel_size` of them (`visible_gpus`). The client and a replica talk over a socket pair
in `dp.protocol` messages (msgspec, never pickle).

Invariants:
- a batch is routed by a `routing.Router`: with prefix caching, to the replica where the longest
  prefix of the request's hash chain can resume (as the replicas' `CacheEvents` said: device
  over host over disk, minus load; requests with images or of a salt in a session keep their
  session, the salt, on one replica), else by `routing.pick` on the salt and first
  `prefix_match_unit` tokens (requests sharing a cacheable prefix meet on one replica unless it
  is `SPILL` sequences busier than the least loaded); without prefix caching every request goes
  to the least loaded replica, its rendezvous replica among equals;
- `generate` returns what one engine would: outputs in input order, request ids from the
  `LLM`'s counter; every request is validated before any runs (a refusal raises the
  `InvalidRequestError` one engine would and leaves nothing queued); greedy and seeded requests
  give the same tokens, unseeded random ones draw from their replica's engine seed;
- a replica that exits, reports a failure, or with work says nothing for `distributed_timeout`
  seconds is lost (killed if it still runs; the router forgets what it published) and fails
  only its own requests: the call raises
  `ReplicaFailure` once the other replicas' requests are done, with their outputs in its
  `outputs`; later calls go to the replicas left (with none left they raise the failure);
- `shutdown` stops every replica; a replica exits when the client's process does."""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import msgspec
from tqdm.auto import tqdm

from ...cache.events import CacheEvents
from ..config import EngineConfig
from ..exec.ranks import TORCHRUN_ENV, config_json
from ..request.mm_inputs import ImagePrompts
from ..request.outputs import RequestOutput
from ..request.sampling_params import SamplingParams
from ..request.sequence import InvalidRequestError
from .configs import replica_configs, visible_gpus
from .protocol import (
    DP_PROTOCOL_VERSION,
    Abort,
    Add,
    Added,
    Call,
    Failed,
    Link,
    Outputs,
    Ready,
    Result,
    Shutdown,
    ToClient,
    request_to_wire,
)
from .replica import REPLICA_ENV
from .routing import SPILL, Router, prompt_hashes, token_key

POLL = 0.2  # seconds between liveness checks while waiting
STOP_TIMEOUT = 15.0  # seconds a replica gets to stop (its worker ranks too) before it is killed


class ReplicaFailure(RuntimeError):
    """A data-parallel replica exited, failed, or stopped answering. From `generate`, `outputs`
    holds the call's outputs in input order, None for the requests the lost replica had."""

    def __init__(self, replica: int, reason: str, outputs: list[RequestOutput | None] | None = None):
        super().__init__(f"data-parallel replica {replica} failed: {reason}")
        self.replica, self.reason, self.outputs = replica, reason, outputs


@dataclass
class _Replica:
    index: int
    proc: subprocess.Popen
    link: Link
    failure: ReplicaFailure | None = None  # set once it is lost


def _spawn(index: int, c: EngineConfig, dp: int) -> _Replica:
    mine, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    gpus = visible_gpus(c, index, dp)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env[REPLICA_ENV] = json.dumps({"config": config_json(c), "fd": theirs.fileno(), "index": index})
    try:
        cmd = [sys.executable, "-m", "deltaserve.engine.dp.replica"]
        proc = subprocess.Popen(cmd, env=env, pass_fds=[theirs.fileno()])
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return _Replica(index, proc, Link(mine, ToClient))


class DPClient:
    def __init__(self, config: EngineConfig, tokenizer):
        self.config, self.timeout = config, config.distributed_timeout
        self.replicas: list[_Replica] = []
        self._closed = False
        self._seq = 0
        self.spill = SPILL if config.enable_prefix_caching else 0
        self.router = Router()
        configs = replica_configs(config)
        atexit.register(self.kill)
        try:
            for i, c in enumerate(configs):
                self.replicas.append(_spawn(i, c, config.data_parallel_size))
            readies = [self._expect(r, Ready, None) for r in self.replicas]
        except BaseException:
            self.kill()
            raise
        first = readies[0]
        if any(r.version != DP_PROTOCOL_VERSION for r in readies):
            self.kill()
            raise RuntimeError(f"a replica speaks another protocol version than {DP_PROTOCOL_VERSION}")
        self.max_model_len, self.family, self.vocab_size = first.max_model_len, first.family, first.vocab_size
        self.model_id, self.unit = first.model_id, first.unit
        memory = [r.rank_memory for r in readies]
        self.rank_memory = None if None in memory else [m for ranks in memory for m in ranks]
        # client side only `expand_rendered` is used, which needs to know the replicas take images
        self.image_prompts = ImagePrompts(
            tokenizer,
            first.media_pad_id,
            first.accepts_images or None,
            first.max_model_len,
            config.max_image_patches_per_request,
        )

    def _lose(self, r: _Replica, reason: str) -> ReplicaFailure:
        """`r` lost (killed if it still runs); the others go on."""
        if r.failure is None:
            r.failure = ReplicaFailure(r.index, reason)
            self.router.forget(r.index)
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
            r.link.close()
        return r.failure

    def _live(self) -> list[_Replica]:
        return [r for r in self.replicas if r.failure is None]

    def _take(self, r: _Replica):
        """The next message of `r` (readable); raises `ReplicaFailure` on `Failed` or a closed socket."""
        try:
            msg = r.link.recv()
        except msgspec.DecodeError as e:
            raise self._lose(r, f"sent a malformed message ({e})")
        except (EOFError, OSError):
            try:
                code = r.proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            raise self._lose(r, f"pid {r.proc.pid} closed its connection (exit code {code})")
        if isinstance(msg, Failed):
            raise self._lose(r, msg.reason)
        if isinstance(msg, CacheEvents):
            self.router.index.apply(r.index, msg)
        return msg

    def _wait(self, rs: list[_Replica], heard: dict[int, float] | None) -> list[tuple[_Replica, object]]:
        """The messages of whichever of `rs` speak within `POLL` s; raises `ReplicaFailure` for
        one that exited or (when `heard` has its last message's time) is silent past the timeout."""
        rs = [r for r in rs if r.failure is None]
        socks = {r.link.sock: r for r in rs}
        wait = 0 if any(r.link.buffered() for r in rs) else POLL
        readable = {socks[s].index for s in select.select(list(socks), [], [], wait)[0]} if rs else set()
        got = [(r, msg) for r in rs if r.index in readable or r.link.buffered() for msg in self._heard(r, False)]
        now = time.monotonic()
        for r, _ in got:
            if heard is not None:
                heard[r.index] = now
        for r in rs:
            if r.failure is None and r.proc.poll() is not None:
                got += [(r, msg) for msg in self._heard(r, True)]
                self._lose(r, f"pid {r.proc.pid} exited with code {r.proc.returncode}")
            if r.failure is None and heard is not None and now - heard[r.index] > self.timeout:
                self._lose(r, f"said nothing for {self.timeout:g} s with requests in flight")
        return got

    def _heard(self, r: _Replica, drain: bool) -> list:
        """`r`'s next message (it is readable), or with `drain` all it has sent; none once lost."""
        msgs = []
        try:
            if not drain:
                msgs.append(self._take(r))
            while drain and r.failure is None and r.link.ready(0):
                msgs.append(self._take(r))
        except ReplicaFailure:
            pass
        return msgs

    def _expect(self, r: _Replica, kind: type, heard: dict[int, float] | None):
        """The next `kind` message of `r`, skipping stale `Outputs` (of aborted requests)."""
        while True:
            for _, msg in self._wait([r], heard):
                if isinstance(msg, kind):
                    return msg
            if r.failure is not None:
                raise r.failure

    def _send(self, r: _Replica, msg) -> None:
        """`msg` sent to `r`; a replica that cannot be reached is lost (no raise)."""
        try:
            r.link.send(msg)
        except OSError as e:
            self._lose(r, f"cannot be reached ({e})")

    def _check(self) -> list[int]:
        """The live replicas' indices; raises the first failure when none is left."""
        live = [r.index for r in self._live()]
        if not live:
            raise next(r.failure for r in self.replicas if r.failure is not None)
        if self._closed:
            raise RuntimeError("the LLM was shut down")
        return live

    def generate(self, staged: list[tuple], use_tqdm: bool) -> list[RequestOutput]:
        """`staged`: (request id, prompt ids, params, prompt text, cache salt, images) per
        request, as `LLM.generate` builds them; the outputs in the same order."""
        self._absorb()
        live = self._check()
        self._seq += 1
        loads, batches, refused = [0] * len(self.replicas), {}, []
        for pos, (rid, ids, p, text, salt, images) in enumerate(staged):
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(p).__name__}")
            vocab = self.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                refused.append((0, pos, f"prompt token ids must be ints in [0, {vocab})"))  # not encodable
                continue
            i = self._route(ids, salt, images, loads, live)
            loads[i] += p.n
            batches.setdefault(i, []).append(pos)
        adds = {i: Add(self._seq, [request_to_wire(*staged[p]) for p in ps]) for i, ps in batches.items()}
        results: dict[str, RequestOutput] = {}
        try:
            self._run(adds, batches, refused, len(staged), results, use_tqdm)
        finally:
            for i, positions in batches.items():
                left = [staged[p][0] for p in positions if staged[p][0] not in results]
                if left and not self._closed and self.replicas[i].failure is None:
                    self._send(self.replicas[i], Abort(left))
        outs = [results.get(s[0]) for s in staged]
        if None in outs:  # a replica was lost: its requests have no output
            i = next(i for i, ps in sorted(batches.items()) if any(outs[p] is None for p in ps))
            f, n = self.replicas[i].failure, outs.count(None)
            raise ReplicaFailure(i, f"{f.reason} ({n} of the call's {len(outs)} requests were on it)", outs)
        return outs

    def _absorb(self) -> None:
        """Take what the live replicas sent since the last call (`CacheEvents` of idle ones;
        anything else is stale: `_expect` would skip it), so routing sees their latest state."""
        for r in self._live():
            self._heard(r, True)

    def _route(self, ids, salt, images, loads, live) -> int:
        """The replica `self.router` picks for one request (see the module docstring)."""
        hashes = prompt_hashes(ids, self.model_id, salt, self.unit) if self.unit and not images else []
        key = token_key(ids, salt, self.config.prefix_match_unit)
        return self.router.route(key, hashes, loads, live, salt, self.spill).replica

    def _run(self, adds: dict, batches: dict, refused: list, total: int, results: dict, use_tqdm: bool) -> None:
        """Send the batches, then collect answers until every request finished; raises the
        `InvalidRequestError` of the first refused request once every replica has answered."""
        pending = {i: {w.request_id for w in add.requests} for i, add in adds.items()}
        acks: dict[int, Added] = {}
        now = time.monotonic()
        heard = {i: now for i in adds}
        for i, add in adds.items():
            self._send(self.replicas[i], add)
        with tqdm(total=total, disable=not use_tqdm, desc="generate") as bar:
            while True:
                for i in adds:
                    if self.replicas[i].failure is not None:  # lost: its requests get no output
                        acks.setdefault(i, Added(self._seq))
                        pending[i].clear()
                if len(acks) == len(adds):
                    errors = refused + [(a.phase, batches[i][a.index], a.error) for i, a in acks.items() if a.error]
                    if errors:
                        raise InvalidRequestError(min(errors)[2])
                    if not any(pending.values()):
                        return
                busy = [self.replicas[i] for i in adds if i not in acks or pending[i]]
                for r, msg in self._wait(busy, heard):
                    if isinstance(msg, Added) and msg.seq == self._seq:
                        acks[r.index] = msg
                        if msg.error is not None:  # it queued none of them
                            pending[r.index].clear()
                    elif isinstance(msg, Outputs):
                        for out in msg.outputs:
                            if out.request_id in pending.get(r.index, ()):
                                pending[r.index].discard(out.request_id)
                                results[out.request_id] = out
                                bar.update(1)

    def _call(self, name: str) -> list:
        """`name` (a `dp_protocol.CALLS` entry) run on every live replica: their answers in order."""
        live = [self.replicas[i] for i in self._check()]
        self._seq += 1
        for r in live:
            self._send(r, Call(self._seq, name))
        answers = []
        for r in live:
            heard = {r.index: time.monotonic()}
            result = self._expect(r, Result, heard)
            while result.seq != self._seq:  # a late answer to an interrupted call
                result = self._expect(r, Result, heard)
            if result.error is not None:
                if name == "check_integrity":
                    raise AssertionError(f"replica {r.index}: {result.error}")
                raise RuntimeError(f"replica {r.index}: {name}: {result.error}")
            answers.append(result.value)
        return answers

    def stats(self) -> dict:
        """Integer figures summed over the live replicas (`page_size` is every replica's; wide EP:
        `expert_load`, the tokens every expert ran, each from the replica holding it),
        `replicas`: each live replica's own stats, `replicas_live`: how many there are."""
        each = self._call("stats")
        total = {
            k: v if k == "page_size" else sum(s[k] for s in each)
            for k, v in each[0].items()
            if isinstance(v, int) and not isinstance(v, bool)
        }
        routed = dict(self.router.decisions)
        loads = [s["expert_load"] for s in each if "expert_load" in s]
        if loads:  # wide EP: each replica's experts' tokens, in expert order
            total["expert_load"] = [n for load in sorted(loads, key=lambda x: x["first"]) for n in load["tokens"]]
        return total | {
            "data_parallel_size": len(self.replicas),
            "replicas_live": len(each),
            "replicas": each,
            "routing": routed,
        }

    def reset_prefix_cache(self) -> bool:
        return all(self._call("reset_prefix_cache"))

    def check_integrity(self) -> None:
        self._call("check_integrity")

    def shutdown(self) -> None:
        """Stop every live replica (idempotent); lost ones were killed already."""
        if self._closed:
            self.kill()
            return
        self._closed = True
        live = self._live()
        for r in live:
            try:
                r.link.send(Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT
        for r in live:
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
            r.link.close()

    def kill(self) -> None:
        self._closed = True
        for r in self.replicas:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
            r.link.close()
