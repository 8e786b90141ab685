"""`LockStep`: the step loop of one wide expert-parallel replica (data-parallel attention, experts
split over the replicas), in step with the other replicas for the MoE all-to-alls.

Every replica calls `sync` once per round: one all-reduce (MAX) over the replicas' TP rank 0s
(`tp.dp_group`; the expert-parallel group itself at TP 1) of (has work, wants to stop). Where any
replica has work, every replica runs exactly one model forward in that round (`step`): its own
engine step, or, with nothing scheduled, a zero-token forward (`ModelRunner.idle_forward`:
`KimiForCausalLM.idle_forward` on each of the replica's TP ranks, its workers told by an `Idle`
message; counted in `counters["idle_forwards"]`), so the collectives of a round pair up and a
replica without requests never stalls one with them. Where one wants to stop, all stop after the
same round. A replica that dies makes the others' next collective fail after `distributed_timeout`
seconds.

Invariant: an `EngineCore.step` runs at most one model forward and counts it in
`counters["steps"]` (a speculative step's fold touches no MoE layer).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .loop import EngineCore


class LockStep:
    def __init__(self, core: EngineCore):
        tp = core.model.tp
        if tp.ep_world < 2:
            raise ValueError("lock-step rounds are for a wide expert-parallel replica (ep_world > 1)")
        self.core, self.group = core, tp.dp_group if tp.world > 1 else tp.ep_group

    def sync(self, busy: bool, stop: bool) -> tuple[bool, bool]:
        """(any replica has work, any replica stops): one collective, called by every replica."""
        flags = torch.tensor([int(busy), int(stop)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])

    def step(self, run: Callable[[], list] | None = None) -> list:
        """This round's forward: the engine's step (`run`, default `core.step`; the server's
        `core.step_deltas`), or a zero-token one where it ran none. Returns what `run` did ([])."""
        core = self.core
        before = core.counters["steps"]
        outs = (run or core.step)() if core.scheduler.has_work() else []
        if core.counters["steps"] == before:
            core.runner.idle_forward()
            core.counters["idle_forwards"] += 1
        core.counters["ep_rounds"] += 1
        return outs
