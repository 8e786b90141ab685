"""`ParallelContext`: which tensor-parallel rank a model is built for, and the collectives its
layers call.

Invariants:
- A parameter marked with `shard(p, dim)` holds, on rank r of W, the contiguous chunk r of W equal
  chunks of the checkpoint tensor along `dim` (heads, the intermediate dim or the vocab); every
  other parameter is replicated.
- A layer's forward returns the full, unsharded result on every rank: a row-parallel projection's
  partial sum is all-reduced (once) before anything nonlinear reads it.
- `SINGLE` (world 1) makes every collective the identity, so an unsharded model computes exactly
  what it computed before tensor parallelism existed.
- Under expert parallelism (`expert_parallel`) routed experts split by expert across the whole
  group instead of by their intermediate dim; everything else is as under plain TP.
- Wide expert parallelism (`ep_world` > 1, attention data-parallel): routed experts split by
  expert over the `ep_world` = D x `world` ranks of `ep_group` (every rank of D data-parallel
  replicas, each a tensor-parallel group of `world`: replica i's TP rank t is EP rank i `world` + t),
  tokens exchanged by all-to-all (`ep_all_to_all`); every rank of `ep_group` must run the same
  sequence of MoE layers, a replica without work on zero tokens. `dp_group` holds the replicas'
  TP rank 0s (their lock-step rounds; None: the default group, every rank a replica).
- Decode context parallelism (`dcp_world` D, dividing `world`) splits the MLA latent cache by
  position: the DCP group of a rank is the D consecutive ranks sharing `rank // D`, and token
  position t lives on DCP rank `t % D` of it.
- The default process group belongs to the engine that created it (`init_tensor_parallel`) until
  it leaves (`leave_tensor_parallel`); a group someone else initialised, or one another engine of
  this process still holds, is refused (`ProcessGroupTaken`), never silently shared.
- Only tensor collectives are used: nothing is pickled between ranks. Ranks on one machine
  reduce and gather through shared memory (`shm`), falling back to the process group for
  tensors larger than its slots.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .shm import ShmCollectives


class CommClock:
    """Wall time this process spent inside collectives (world > 1 only), for the benchmarks."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    @contextmanager
    def timed(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


COMM = CommClock()


Reduce = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""A tensor-parallel rank's sum over the ranks, as `ParallelContext.sum`: (partial, replicated or
None) -> the sum of every rank's partial (plus `replicated` once); may return `partial` itself,
summed in place."""


@dataclass(frozen=True)
class ParallelContext:
    """Rank `rank` of a tensor-parallel group of `world` processes (`group`: a torch.distributed
    process group, None for the default one)."""

    rank: int = 0
    world: int = 1
    group: object = None
    expert_parallel: bool = False
    dcp_world: int = 1
    dcp_group: object = None
    shm: object = None  # `shm.ShmCollectives` when every rank is on this machine
    ep_rank: int = 0  # wide expert parallelism: this rank's place in `ep_group`
    ep_world: int = 1
    ep_group: object = None  # None: the default group
    dp_group: object = None  # wide EP: the replicas' TP rank 0s (None: the default group)

    def __post_init__(self):
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a tensor-parallel group of {self.world}")
        if not 0 <= self.ep_rank < self.ep_world:
            raise ValueError(f"rank {self.ep_rank} outside an expert-parallel group of {self.ep_world}")
        if self.ep_world > 1 and (self.ep_world % self.world or self.ep_rank % self.world != self.rank):
            raise ValueError(
                f"expert-parallel rank {self.ep_rank} of {self.ep_world} is not tensor-parallel rank {self.rank} "
                f"of a replica of {self.world}"
            )
        if self.dcp_world < 1 or self.world % self.dcp_world:
            raise ValueError(
                f"decode-context-parallel size {self.dcp_world} must divide the tensor-parallel size {self.world}"
            )

    @property
    def dcp_rank(self) -> int:
        """This rank's index in its DCP group (the positions t with t % dcp_world == dcp_rank)."""
        return self.rank % self.dcp_world

    def dcp_all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every DCP-group rank's `x` concatenated along `dim`, in DCP-rank order."""
        if self.dcp_world == self.world:  # the DCP group is the whole group
            return self.all_gather(x, dim)
        return _gather(x, dim, self.dcp_world, self.dcp_group)

    @property
    def expert_world(self) -> int:
        """Ranks the routed experts are split over by expert (1: every rank holds every expert)."""
        if self.ep_world > 1:
            return self.ep_world
        return self.world if self.expert_parallel else 1

    @property
    def expert_rank(self) -> int:
        """This rank's index among the `expert_world` ranks holding the routed experts."""
        return self.ep_rank if self.ep_world > 1 else self.rank if self.expert_parallel else 0

    def ep_all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Wide EP: rows `x` cut by `in_splits` (one count per rank of `ep_group`) sent to those ranks;
        returns the rows every rank sent here, by source rank (`out_splits`)."""
        x = x.contiguous()
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        with COMM.timed():
            dist.all_to_all_single(out, x, out_splits, in_splits, group=self.ep_group)
        return out

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` (heads, a width, the vocab); `n` must divide evenly."""
        if n % self.world:
            raise ValueError(f"{what} ({n}) does not divide by the tensor-parallel size {self.world}")
        return n // self.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place: `x` must be a fresh tensor the caller owns)."""
        if self.world > 1:
            with COMM.timed():
                if self.shm is not None and self.shm.fits(x):
                    self.shm.all_reduce(x)
                else:
                    dist.all_reduce(x, group=self.group)
        return x

    def reduce_sum(self, partial: torch.Tensor, replicated: torch.Tensor) -> torch.Tensor:
        """`replicated + all_reduce(partial)` in one collective: the replicated term (equal on every
        rank) joins the sum on rank 0 only."""
        if self.world == 1:
            return replicated + partial
        return self.all_reduce(replicated + partial if self.rank == 0 else partial)

    def sum(self, partial: torch.Tensor, replicated: torch.Tensor | None = None) -> torch.Tensor:
        """`all_reduce(partial)`, or `reduce_sum(partial, replicated)` with a replicated term: the
        tensor-parallel sums of a decode step, as the whole-stack kernel calls them back."""
        return self.all_reduce(partial) if replicated is None else self.reduce_sum(partial, replicated)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.world > 1 and self.shm is not None and self.shm.fits(x):
            with COMM.timed():
                return self.shm.all_gather(x, dim)
        return _gather(x, dim, self.world, self.group)


def _gather(x: torch.Tensor, dim: int, n: int, group) -> torch.Tensor:
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    with COMM.timed():
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()


def shard(p: nn.Parameter, dim: int) -> nn.Parameter:
    """Mark `p` as split along `dim` across the tensor-parallel ranks (the loader reads only this
    rank's chunk of the checkpoint tensor); returns `p`."""
    p.tp_dim = dim
    return p


class ProcessGroupTaken(RuntimeError):
    """torch.distributed's default group exists already: a tensor-parallel engine needs its own."""


_owned: list = []  # the default group `init_tensor_parallel` created, while it lives


def check_process_group_free() -> None:
    """Raise `ProcessGroupTaken` if this process already has a default process group."""
    if not dist.is_initialized():
        return
    if _owned and _owned[0] is dist.group.WORLD:
        raise ProcessGroupTaken(
            "another tensor-parallel engine of this process still holds the process group: shut it down "
            "first (llm.shutdown(), or leave its `with` block)"
        )
    raise ProcessGroupTaken(
        "torch.distributed is already initialised in this process, not by deltaserve: a tensor-parallel "
        "engine creates and owns its process group (call torch.distributed.destroy_process_group() first; "
        "under torchrun, let the engine join from the environment)"
    )


def leave_tensor_parallel(failed: bool = False) -> None:
    """Destroy the default group (and its subgroups) if `init_tensor_parallel` created it; a no-op
    otherwise. `failed`: a peer may be dead or hung, so a CUDA group is aborted, not destroyed."""
    mine = bool(_owned) and dist.is_initialized() and _owned[0] is dist.group.WORLD
    _owned.clear()
    if not mine:
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed and abort is not None and "nccl" in str(dist.get_backend()):
        abort()
    else:
        dist.destroy_process_group()


def process_group_backend(device: str | torch.device) -> str:
    """gloo on CPU; on CUDA nccl for device tensors and gloo for host ones (the load report)."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(
    rank: int,
    world: int,
    init_method: str,
    device: str | torch.device = "cpu",
    timeout_s: float = 120.0,
    expert_parallel: bool = False,
    dcp_world: int = 1,
    shm_slot_bytes: int = 0,
) -> ParallelContext:
    """Join the default process group (`process_group_backend(device)`) as `rank` of `world` and
    return the context a model is built with (its DCP subgroups created on every rank). With
    `shm_slot_bytes` > 0, CPU ranks that all run on this machine reduce and gather tensors up to
    that size through shared memory (`shm.ShmCollectives`). Refuses a process that has a default
    group already (`ProcessGroupTaken`); on failure the group it created is left again."""
    check_process_group_free()
    backend = process_group_backend(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    _owned[:] = [dist.group.WORLD]
    try:
        return _subgroups(rank, world, backend, timeout_s, expert_parallel, dcp_world, shm_slot_bytes)
    except BaseException:
        leave_tensor_parallel(failed=True)
        raise


def init_expert_parallel(
    replica: int,
    replicas: int,
    init_method: str,
    device: str | torch.device = "cpu",
    timeout_s: float = 120.0,
    tp_rank: int = 0,
    tp_size: int = 1,
    control_timeout: datetime.timedelta | None = None,
    shm_slot_bytes: int = 0,
) -> tuple[ParallelContext, object]:
    """Join the default process group of `replicas` x `tp_size` ranks as TP rank `tp_rank` of
    data-parallel replica `replica`; returns the wide expert-parallel context of its model
    (attention split over the replica's `tp_size` ranks, experts over every rank) and the
    replica's gloo control group (None at `tp_size` 1). Every rank creates every replica's
    subgroups in the same order (torch.distributed requires it); with `shm_slot_bytes` > 0 a
    replica's CPU ranks on one machine reduce and gather through shared memory. The group is this
    engine's as under `init_tensor_parallel` (`leave_tensor_parallel`)."""
    check_process_group_free()
    world, me = replicas * tp_size, replica * tp_size + tp_rank
    backend = process_group_backend(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=me,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _owned[:] = [dist.group.WORLD]
    if tp_size == 1:
        return ParallelContext(ep_rank=me, ep_world=world), None
    try:
        tp_group = control = None
        for i in range(replicas):
            ranks = list(range(i * tp_size, (i + 1) * tp_size))
            group = dist.new_group(ranks)
            ctl = dist.new_group(ranks, backend="gloo", timeout=control_timeout)
            if i == replica:
                tp_group, control = group, ctl
        leaders = dist.new_group([i * tp_size for i in range(replicas)], backend="gloo")
        shm = None
        if shm_slot_bytes and backend == "gloo":
            shm = ShmCollectives.create(tp_rank, tp_size, shm_slot_bytes, timeout_s, tp_group)
        tp = ParallelContext(tp_rank, tp_size, tp_group, shm=shm, ep_rank=me, ep_world=world, dp_group=leaders)
        return tp, control
    except BaseException:
        leave_tensor_parallel(failed=True)
        raise


def _subgroups(rank, world, backend, timeout_s, expert_parallel, dcp_world, shm_slot_bytes) -> ParallelContext:
    dcp_group = None
    if 1 < dcp_world < world:
        if world % dcp_world:
            raise ValueError(f"decode-context-parallel size {dcp_world} must divide the tensor-parallel size {world}")
        for first in range(0, world, dcp_world):
            g = dist.new_group(list(range(first, first + dcp_world)))
            if first == rank - rank % dcp_world:
                dcp_group = g
    shm = None
    if shm_slot_bytes and world > 1 and backend == "gloo":
        shm = ShmCollectives.create(rank, world, shm_slot_bytes, timeout_s)
    return ParallelContext(rank, world, None, expert_parallel, dcp_world, dcp_group, shm)
