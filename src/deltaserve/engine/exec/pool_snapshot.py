"""`pool_snapshot`: every rank's pools gathered on all ranks, in the unsharded layout.

A collective: every rank of the group calls it at the same point (rank 0 sends `Snapshot`
first). KDA tails and states are concatenated over the ranks' heads in the order a single
process holds them (the conv tail's q, k and v channels each by head), so a tensor-parallel
engine's snapshot equals a one-process engine's after the same requests, up to float noise;
the MLA storage is stacked per rank (`mla[r]`: rank r's rows; equal on every rank under plain TP).
"""

from __future__ import annotations

import torch

from ...cache.kda_pool import KdaStatePool
from ...cache.mla_pool import MlaPagePool
from ...parallel import ParallelContext


def _tails(tp: ParallelContext, tails: torch.Tensor) -> torch.Tensor:
    qkv = tails.unflatten(-1, (3, -1))
    return tp.all_gather(qkv, dim=-1).flatten(-2)


def pool_snapshot(
    tp: ParallelContext, mla: MlaPagePool, kda: KdaStatePool, checkpoints: KdaStatePool | None
) -> dict[str, torch.Tensor]:
    out = {
        "mla": tp.all_gather(mla.storage.unsqueeze(0), dim=0),
        "live_tails": _tails(tp, kda.tails),
        "live_states": tp.all_gather(kda.states, dim=2),
    }
    if checkpoints is not None:
        out["checkpoint_tails"] = _tails(tp, checkpoints.tails)
        out["checkpoint_states"] = tp.all_gather(checkpoints.states, dim=2)
    return out
