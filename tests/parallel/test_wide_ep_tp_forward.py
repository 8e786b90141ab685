"""Wide expert parallelism with tensor parallelism inside each replica, at the model: 4 gloo ranks
as 2 data-parallel replicas x TP 2 (attention split by heads inside a replica, the routed experts
split by expert over all 4 ranks), each TP rank dispatching its share of the replica's rows.
Every rank's fp32 logits equal the unsharded model's on its replica's tokens (both families), a
replica of fewer rows than TP ranks included; each rank holds a quarter of the experts' bytes; an
idle replica's TP ranks running `idle_forward` keep the other replica going. Each replica's TP
collectives go through its own shared-memory segment."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from deltaserve.model.moe_layer import MoeBlock
from deltaserve.parallel import init_expert_parallel, leave_tensor_parallel
from tests.parallel.test_tp_forward import SEQ, _ids, _load, _rel, checkpoints  # noqa: F401 (fixture)

from .spawned import exit_worker

DP, TP = 2, 2
NAMES = ("k3", "kl")
SPANS = ((0, 15), (15, SEQ))  # each replica's tokens of `_ids()`: different lengths
SHORT = ((0, 1), (15, 18))  # then one row on replica 0 (TP rank 1's share empty), three on replica 1


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".experts." in n)


def _worker(rank: int, init_method: str, ckpts: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    replica, t = divmod(rank, TP)
    tp, _ = init_expert_parallel(replica, DP, init_method, tp_rank=t, tp_size=TP, shm_slot_bytes=1 << 20)
    try:
        assert tp.shm is not None and tp.shm.world == TP  # the replica's own shared-memory segment
        ids = _ids()
        for name in NAMES:
            model = _load(ckpts[name], name, "float32", tp)
            got = {"logits": model.forward_full(ids[slice(*SPANS[replica])])}
            got["short"] = model.forward_full(ids[slice(*SHORT[replica])])
            if replica == 0:  # alone: replica 1's ranks run zero-token forwards meanwhile
                got["alone"] = model.forward_full(ids[slice(*SPANS[0])])
            else:
                model.idle_forward()
            blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
            got["bytes"] = torch.tensor(_expert_bytes(model))
            got["first"] = torch.tensor([b.experts.first for b in blocks])
            got["load"] = torch.stack([b.experts.expert_load for b in blocks])
            save_file(got, f"{out}/{name}_{rank}.safetensors")
        torch.distributed.barrier()
    finally:
        leave_tensor_parallel()
    exit_worker()


def test_wide_ep_with_tp_logits_match_the_whole_model(checkpoints, tmp_path):
    init = f"file://{tmp_path / 'store'}"
    args = (init, {k: str(checkpoints[k]) for k in NAMES}, str(tmp_path))
    mp.start_processes(_worker, args=args, nprocs=DP * TP, join=True, start_method="spawn")
    ids = _ids()
    for name in NAMES:
        whole = _load(checkpoints[name], name, "float32")
        e, k = whole.config.moe.num_experts, whole.config.moe.top_k
        loads = []
        for rank in range(DP * TP):
            replica = rank // TP
            got = load_file(str(tmp_path / f"{name}_{rank}.safetensors"))
            for key, span in (("logits", SPANS[replica]), ("short", SHORT[replica]), ("alone", SPANS[0])):
                if key in got:
                    ref = whole.forward_full(ids[slice(*span)])
                    assert _rel(got[key], ref) <= 1e-5, (name, rank, key)
                    assert torch.equal(got[key].argmax(-1), ref.argmax(-1)), (name, rank, key)
            assert got["bytes"].item() * DP * TP == _expert_bytes(whole), (name, rank)
            assert (got["first"] == rank * e // (DP * TP)).all()
            loads.append(got["load"])
        # every pair of every row ran once, on its expert's rank: replica 0's rows twice
        rows = 2 * (SPANS[0][1] - SPANS[0][0]) + SPANS[1][1] - SPANS[1][0] + 1 + 3
        pairs = torch.cat(loads, dim=1).sum(1)
        assert (pairs == k * rows).all(), (name, pairs)
