"""A tensor-parallel rank other than 0: load its shard, then run the forward passes rank 0
sends (with the image rows rank 0's vision model made, `Step.embeds`) until `Shutdown`.
`python -m deltaserve.engine.exec.worker` is how a spawned rank starts (its config, rank and
rendezvous in the `DELTASERVE_WORKER` environment variable, as JSON).

The worker holds the same pools as rank 0 over its own heads (and, under DCP, positions), but no
cache manager: it replays rank 0's slot writes (`Step.ops`) and computes; in a prefill or decode
role it also moves its pools' share of each handoff (`rank_transfer`). Any error exits the
process non-zero, which rank 0 sees (`RankGroup`) and turns into a failed engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import msgspec
import torch

from ...cache import CacheLayout, build_pools
from ...cache.handoff import pool_tensors
from ...cache.slot_journal import CHECKPOINT, LIVE, MLA, replay
from ...model import KimiForCausalLM, load_model, resolve_dtype
from ...model.experts import expert_load
from ...parallel import ParallelContext
from ..config import EngineConfig
from .channel import ControlChannel
from .messages import (
    PROTOCOL_VERSION,
    Collect,
    Digest,
    ExpertLoad,
    Fold,
    Hello,
    Idle,
    Pull,
    Shutdown,
    Snapshot,
    Step,
    TransferSetup,
)
from .pool_snapshot import pool_snapshot
from .rank_transfer import serve_transfer
from .ranks import (
    WORKER_ENV,
    RankFailure,
    config_from_json,
    exit_with_parent,
    join,
    memory_report,
    rank_device,
    reset_peak_rss,
)
from .step_batch import forward_batch, logit_hidden

log = logging.getLogger(__name__)


def load_rank_model(config: EngineConfig, tp: ParallelContext) -> tuple[KimiForCausalLM, list[dict[str, int]]]:
    """This rank's shard of the model and every rank's load memory (a collective: all ranks call it)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    before = reset_peak_rss()
    model = load_model(
        config.model,
        dtype=resolve_dtype(config.dtype),
        device=config.device,
        progress=config.progress and tp.rank == 0,
        moe_weights=config.moe_weights,
        tp=tp,
    )
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return model, memory_report(tp, before, weights, getattr(model.model, "prepared", None) is not None)


def layout_of(hello: Hello) -> CacheLayout:
    """The pool counts rank 0 chose (the byte figures are rank 0's to report)."""
    kv, state = resolve_dtype(hello.kv_dtype), resolve_dtype(hello.state_dtype)
    return CacheLayout(hello.page_size, hello.num_pages, hello.num_slots, 0, 0, kv, state, hello.num_checkpoint_slots)


@torch.inference_mode()
def run_worker(config: EngineConfig, tp: ParallelContext, control) -> None:
    """Load, then serve steps until `Shutdown`; raises `RankFailure` on a protocol error."""
    model, _ = load_rank_model(config, tp)
    channel = ControlChannel(control)
    hello = channel.recv()
    if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
        raise RankFailure(f"rank {tp.rank}: expected Hello version {PROTOCOL_VERSION}, got {hello!r}")
    mla, kda, ckpt = build_pools(model.config, layout_of(hello), config.device, tp)
    pools = {LIVE: kda, CHECKPOINT: ckpt, MLA: mla}
    transfer = verifying = None
    while True:
        msg = channel.recv()
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, Fold):
            verifying.set_verified(msg.verified)
            model.fold_kda(verifying)
            verifying = None
            continue
        if isinstance(msg, Snapshot):
            pool_snapshot(tp, mla, kda, ckpt)
            continue
        if isinstance(msg, Idle):
            model.idle_forward()
            continue
        if isinstance(msg, ExpertLoad):
            channel.gather(msgspec.msgpack.encode(expert_load(model)))
            continue
        if isinstance(msg, (TransferSetup, Digest, Pull, Collect)):
            transfer = serve_transfer(msg, channel, pool_tensors(mla, kda), lambda ops: replay(ops, pools), transfer)
            continue
        if not isinstance(msg, Step):
            raise RankFailure(f"rank {tp.rank}: unexpected message {type(msg).__name__}")
        replay(msg.ops, pools)
        batch = forward_batch(msg, mla, kda, ckpt, model.device, tp)
        verifying = batch if msg.verify else None
        if msg.embeds is None:
            hidden = model(batch.input_ids, batch.context())
        else:
            index = torch.tensor(msg.embeds.index, dtype=torch.long)
            hidden = model(batch.input_ids, batch.context(), (index, msg.embeds.rows.tensor(model.device)))
        if msg.logit_rows:
            model.compute_logits(logit_hidden(hidden, msg, batch))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(os.environ[WORKER_ENV])
    exit_with_parent()
    config = config_from_json(spec["config"])
    try:
        config = dataclasses.replace(config, device=rank_device(config, spec["rank"]))
        tp, control = join(config, spec["rank"], spec["init_method"])
        run_worker(config, tp, control)
    except Exception:
        log.exception("worker rank %s failed", spec["rank"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
