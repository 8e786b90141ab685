"""The configs of the offline `LLM`'s data-parallel replicas (engine/dp/client.py spawns them):
one engine each, the machine's threads split over them, each its own tensor-parallel rendezvous
and, on CUDA with enough GPUs, its own GPUs."""

from __future__ import annotations

import dataclasses
import os
import socket
from contextlib import ExitStack
from urllib.parse import urlsplit

import torch

from ...cache.tiers.disk import replica_disk_path
from ..config import EngineConfig
from ..exec.ranks import free_port


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _init_methods(c: EngineConfig) -> list[str | None]:
    """Each replica's tensor-parallel rendezvous: the given tcp://HOST:PORT moved up by the
    replica's index, else distinct free loopback ports (held open together while chosen)."""
    n = c.data_parallel_size
    if c.tensor_parallel_size == 1:
        return [None] * n
    if c.distributed_init_method:
        url = urlsplit(c.distributed_init_method)
        if url.scheme != "tcp" or url.port is None:
            raise ValueError("with data_parallel_size > 1, distributed_init_method must be tcp://HOST:PORT")
        return [f"tcp://{url.hostname}:{url.port + i}" for i in range(n)]
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in socks]


def replica_configs(c: EngineConfig) -> list[EngineConfig]:
    """The configs of `c`'s replicas: one engine each, threads split, own rendezvous, own disk
    tier directory (`replica_disk_path`)."""
    return [dataclasses.replace(r, kv_disk_path=_disk(c, i)) for i, r in enumerate(_replicas(c))]


def _disk(c: EngineConfig, i: int) -> str | None:
    return None if c.kv_disk_path is None else replica_disk_path(c.kv_disk_path, i)


def _replicas(c: EngineConfig) -> list[EngineConfig]:
    c.check_parallel()
    n = c.data_parallel_size
    threads = c.num_threads or max(1, _cpus() // (n * c.tensor_parallel_size))
    if c.wide_expert_parallel:  # one expert-parallel group over every rank of the replicas
        ep = c.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        return [
            dataclasses.replace(
                c,
                num_threads=threads,
                progress=c.progress and i == 0,
                distributed_init_method=None,
                data_parallel_rank=i,
                data_parallel_init_method=ep,
            )
            for i in range(n)
        ]
    return [
        dataclasses.replace(
            c, data_parallel_size=1, num_threads=threads, progress=c.progress and i == 0, distributed_init_method=init
        )
        for i, init in enumerate(_init_methods(c))
    ]


def visible_gpus(c: EngineConfig, index: int, dp: int) -> str | None:
    """Replica `index`'s `CUDA_VISIBLE_DEVICES` on `c.device` "cuda" / "auto" when at least
    dp x tp GPUs are visible: its own `tensor_parallel_size` of them; else None (shared)."""
    if c.device not in ("cuda", "auto") or not torch.cuda.is_available():
        return None
    tp, listed = c.tensor_parallel_size, os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = listed.split(",") if listed else [str(i) for i in range(torch.cuda.device_count())]
    return ",".join(visible[index * tp : (index + 1) * tp]) if len(visible) >= dp * tp else None
