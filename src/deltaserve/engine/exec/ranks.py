"""`RankGroup`: the processes a tensor-parallel engine runs on, how they start, meet and stop.

Launch modes (`plan_ranks`):
- single node (default): this process is rank 0; it spawns ranks 1..W-1 as `python -m
  deltaserve.engine.exec.worker` subprocesses (the config travels as JSON in their environment) and
  tears them down with it;
- several nodes: every node runs the same command with `--nnodes M --node-rank R
  --distributed-init-method tcp://HOST:PORT`; node R's process is rank R*W/M and spawns the other
  ranks of its node; node 0 holds rank 0 (scheduler and API), other nodes only work;
- an external launcher (`torchrun`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): each process
  is the rank it is given and spawns nothing.

On CUDA each rank runs on GPU <local rank> of its node (`rank_device`: LOCAL_RANK under torchrun,
else the rank's place among its node's ranks).

Every rank joins the default group (gloo on CPU; NCCL for CUDA tensors and gloo for host ones on
CUDA; model collectives, bounded by
`distributed_timeout`; on one machine the CPU ranks reduce through shared memory instead,
`parallel.shm`) and a gloo control group for the step messages, whose wait is unbounded (an
idle server sends nothing). A spawned worker that exits marks the group failed
(`failure`, `on_failure` callbacks); a collective that fails or times out does the same through
the runner. Nothing is pickled: workers get JSON, steps are msgspec (`messages`).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ...env import WORKER
from ...parallel import (
    ParallelContext,
    check_process_group_free,
    init_expert_parallel,
    init_tensor_parallel,
    leave_tensor_parallel,
)
from ..config import EngineConfig

log = logging.getLogger(__name__)

WORKER_ENV = WORKER.name
CONTROL_TIMEOUT = datetime.timedelta(days=30)
SHM_SLOT_BYTES = 16 << 20  # largest tensor a shared-memory collective takes (larger: gloo)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def exit_with_parent() -> None:
    """This process exits (status 1) once the process that spawned it is gone (a daemon thread
    polling the parent pid): spawned ranks, replicas and replica servers never outlive it."""

    def watch(parent: int) -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, args=(os.getppid(),), daemon=True, name="deltaserve-parent-watch").start()


class RankFailure(RuntimeError):
    """A rank died, hung past `distributed_timeout`, or a collective failed: the engine cannot
    go on and the process should exit."""


@dataclass(frozen=True)
class RankPlan:
    world: int
    rank: int  # this process's rank
    init_method: str
    spawn: tuple[int, ...]  # ranks this process starts as local subprocesses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_ranks(config: EngineConfig, env: dict | None = None) -> RankPlan | None:
    """How this process takes part in `config`'s tensor-parallel group; None for one process."""
    env = os.environ if env is None else env
    config.check_parallel()
    world = config.tensor_parallel_size
    if world == 1:
        return None
    if WORKER_ENV in env:
        raise RuntimeError("a deltaserve worker process must not start an engine of its own")
    if config.wide_expert_parallel:  # a wide-EP replica: its TP ranks join the replicas' one group
        return RankPlan(world, 0, config.data_parallel_init_method or "", tuple(range(1, world)))
    if all(k in env for k in TORCHRUN_ENV):
        if int(env["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {env['WORLD_SIZE']} processes for tensor_parallel_size={world}")
        return RankPlan(world, int(env["RANK"]), "env://", ())
    per_node = world // config.nnodes
    init = config.distributed_init_method
    if config.nnodes > 1 and not init:
        raise ValueError("--nnodes > 1 needs --distributed-init-method tcp://HOST:PORT (node 0's address)")
    first = config.node_rank * per_node
    return RankPlan(world, first, init or f"tcp://127.0.0.1:{free_port()}", tuple(range(first + 1, first + per_node)))


def rank_device(config: EngineConfig, rank: int, env: dict | None = None) -> str:
    """The device `rank` runs on. CUDA with several ranks: GPU <local rank> of the rank's node,
    made current (NCCL needs one GPU per rank); otherwise `config.device` as given."""
    device = torch.device(config.device)
    world = config.tensor_parallel_size
    if device.type != "cuda" or world == 1:
        return config.device
    if device.index is not None:
        raise ValueError(
            f"--device {config.device} with --tensor-parallel-size {world}: give --device cuda "
            "(each rank takes GPU <local rank> of its node)"
        )
    env = os.environ if env is None else env
    local = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else rank % (world // config.nnodes)
    count = torch.cuda.device_count()
    if local >= count:
        raise ValueError(f"rank {rank} runs on GPU {local} of its node, which has {count}: one GPU per rank")
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def config_json(config: EngineConfig) -> str:
    values = dataclasses.asdict(config)
    values["model"] = str(config.model)
    for k in ("dtype", "kv_state_dtype"):
        if isinstance(values[k], torch.dtype):
            values[k] = str(values[k]).removeprefix("torch.")
    return json.dumps(values)


def config_from_json(text: str) -> EngineConfig:
    return EngineConfig(**json.loads(text))


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> int:
    """Start a new peak-RSS window (Linux: /proc/self/clear_refs); returns the RSS now, bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    now = _status_kib("VmRSS")
    return (now if now is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_rss_bytes() -> int:
    """Peak RSS since the last `reset_peak_rss` (VmHWM; where unreadable, the process's peak)."""
    peak = _status_kib("VmHWM")
    return (peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def join(config: EngineConfig, rank: int, init_method: str) -> tuple[ParallelContext, object]:
    """Join the default and control groups as `rank`; returns (model context, control group). A
    wide expert-parallel replica's TP rank joins the one group of every replica's ranks
    (`init_expert_parallel` at `config.data_parallel_init_method`)."""
    if config.wide_expert_parallel:
        if not config.data_parallel_init_method:
            raise ValueError("a wide expert-parallel replica needs data_parallel_init_method (its group's rendezvous)")
        return init_expert_parallel(
            config.data_parallel_rank,
            config.data_parallel_size,
            config.data_parallel_init_method,
            config.device,
            config.distributed_timeout,
            rank,
            config.tensor_parallel_size,
            CONTROL_TIMEOUT,
            SHM_SLOT_BYTES,
        )
    tp = init_tensor_parallel(
        rank,
        config.tensor_parallel_size,
        init_method,
        config.device,
        config.distributed_timeout,
        config.enable_expert_parallel,
        config.decode_context_parallel_size,
        SHM_SLOT_BYTES,
    )
    try:
        return tp, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    except BaseException:
        leave_tensor_parallel(failed=True)
        raise


def memory_report(tp: ParallelContext, before: int, weights: int, decode_stack: bool) -> list[dict[str, int]]:
    """Every rank's peak RSS before and after loading, its weight bytes and whether its decode steps
    run as one native call (`decode_stack` 1/0), gathered with a tensor collective; every rank calls
    it right after loading (rank 0 logs it)."""
    mine = torch.tensor([[before, peak_rss_bytes(), weights, int(decode_stack)]], dtype=torch.long)
    rows = tp.all_gather(mine, dim=0)
    keys = ("rss_before_load", "rss_peak_load", "weight_bytes", "decode_stack")
    report = [dict(zip(keys, r.tolist())) for r in rows]
    if tp.rank == 0:
        for r, m in enumerate(report):
            log.info(
                "%s: weights %.1f MiB, peak RSS %.1f MiB at load (%.1f MiB before), decode %s",
                f"rank {r}" if tp.ep_world == 1 else f"expert-parallel rank {tp.ep_rank + r} of {tp.ep_world}",
                m["weight_bytes"] / 2**20,
                m["rss_peak_load"] / 2**20,
                m["rss_before_load"] / 2**20,
                "one native call a step" if m["decode_stack"] else "layer by layer",
            )
    return report


class RankGroup:
    """The local worker processes this process spawned, its membership, and their health."""

    def __init__(self, plan: RankPlan, config: EngineConfig):
        self.plan, self.config = plan, config
        self.procs: dict[int, subprocess.Popen] = {}
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._closing = False
        self._lock = threading.Lock()

    def launch(self) -> None:
        """Start the local worker subprocesses (they join the group themselves); refused while this
        process has a process group (`ProcessGroupTaken`)."""
        check_process_group_free()
        spec = config_json(self.config)
        for r in self.plan.spawn:
            env = dict(os.environ)
            env[WORKER_ENV] = json.dumps({"config": spec, "rank": r, "init_method": self.plan.init_method})
            self.procs[r] = subprocess.Popen([sys.executable, "-m", "deltaserve.engine.exec.worker"], env=env)
        atexit.register(self.kill)
        threading.Thread(target=self._watch, name="deltaserve-ranks", daemon=True).start()

    def join(self) -> tuple[ParallelContext, object]:
        try:
            tp, control = join(self.config, self.plan.rank, self.plan.init_method)
        except BaseException:
            self.abandon()
            raise
        if tp.shm is not None:  # a dead rank ends a shared-memory wait at once
            self.on_failure(tp.shm.abort)
        return tp, control

    def on_failure(self, fn: Callable[[str], None]) -> None:
        """Call `fn(message)` once if the group fails (at once if it already has)."""
        with self._lock:
            self._callbacks.append(fn)
            failed = self.failure
        if failed is not None:
            fn(failed)

    def fail(self, message: str) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = message
            callbacks = list(self._callbacks)
        log.error("tensor-parallel group failed: %s", message)
        for fn in callbacks:
            fn(message)

    def _watch(self) -> None:
        while not self._closing:
            for r, p in self.procs.items():
                code = p.poll()
                if code is not None and not self._closing:
                    self.fail(f"worker rank {r} (pid {p.pid}) exited with code {code}")
                    return
            time.sleep(0.2)

    def close(self, timeout: float = 10.0, failed: bool = False) -> None:
        """Wait for the local workers to exit (after a `Shutdown` was sent), kill stragglers, reap
        them, and leave the process group (aborted where the group failed), so that a later
        engine of this process creates its own."""
        self._closing = True
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        atexit.unregister(self.kill)  # nothing left to kill: the group is not kept alive till exit
        leave_tensor_parallel(failed=failed or self.failure is not None)

    def kill(self) -> None:
        """Kill the local workers (no collective: safe at exit and from any thread)."""
        self._closing = True
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def abandon(self) -> None:
        """A start that failed: kill the workers, then leave the group as a failed one."""
        self.kill()
        self.close(timeout=5.0, failed=True)
