"""Wide expert parallelism at the model: two gloo ranks with data-parallel attention (each its
own tokens, TP 1) and the routed experts split by expert between them, exchanged by all-to-all.
Each rank's fp32 logits equal the unsharded model's on its own tokens (both families); a rank
holds half the experts' bytes and reads only its experts; a rank with no tokens that runs
`idle_forward` keeps the other going (its logits still match). No MoE block gets a native
whole-block plan under wide EP (it would skip the exchange)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from deltaserve.model.moe_layer import MoeBlock
from deltaserve.parallel import ParallelContext
from tests.parallel.test_tp_forward import SEQ, _ids, _load, _rel, checkpoints  # noqa: F401 (fixture)

from .spawned import exit_worker

WORLD = 2
NAMES = ("k3", "kl")
SPANS = ((0, 15), (15, SEQ))  # each rank's tokens of `_ids()`: different lengths


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".experts." in n)


def _worker(rank: int, init_method: str, ckpts: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    ep = ParallelContext(ep_rank=rank, ep_world=WORLD)
    try:
        lo, hi = SPANS[rank]
        for name in NAMES:
            model = _load(ckpts[name], name, "float32", ep)
            got = {"logits": model.forward_full(_ids()[lo:hi]), "bytes": torch.tensor(_expert_bytes(model))}
            if rank == 0:  # alone: rank 1 runs zero-token forwards meanwhile
                got["alone"] = model.forward_full(_ids()[lo:hi])
            else:
                model.idle_forward()
            blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
            got["first"] = torch.tensor([b.experts.first for b in blocks])
            got["load"] = torch.stack([b.experts.expert_load for b in blocks])
            save_file(got, f"{out}/{name}_{rank}.safetensors")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_wide_ep_logits_match_the_whole_model(checkpoints, tmp_path):
    init = f"file://{tmp_path / 'store'}"
    args = (init, {k: str(checkpoints[k]) for k in NAMES}, str(tmp_path))
    mp.start_processes(_worker, args=args, nprocs=WORLD, join=True, start_method="spawn")
    ids = _ids()
    for name in NAMES:
        whole = _load(checkpoints[name], name, "float32")
        e, k = whole.config.moe.num_experts, whole.config.moe.top_k
        loads = []
        for rank, (lo, hi) in enumerate(SPANS):
            got = load_file(str(tmp_path / f"{name}_{rank}.safetensors"))
            ref = whole.forward_full(ids[lo:hi])
            assert _rel(got["logits"], ref) <= 1e-5, (name, rank)
            assert torch.equal(got["logits"].argmax(-1), ref.argmax(-1)), (name, rank)
            if "alone" in got:
                assert _rel(got["alone"], ref) <= 1e-5, name
            assert got["bytes"].item() * WORLD == _expert_bytes(whole), (name, rank)
            assert (got["first"] == rank * e // WORLD).all()
            loads.append(got["load"])
        # every pair of every token ran once, on its expert's rank: rank 0's tokens twice
        pairs = torch.cat(loads, dim=1).sum(1)
        assert (pairs == k * (2 * (SPANS[0][1] - SPANS[0][0]) + SPANS[1][1] - SPANS[1][0])).all(), (name, pairs)


def test_wide_ep_blocks_get_no_native_plan(checkpoints):
    """A native whole-block MoE plan runs only the rank's own experts and no exchange: under wide
    EP no block (nor the whole-stack decode step) may have one, on any backend."""
    for rank in range(WORLD):
        model = _load(checkpoints["k3_mx"], "k3_mx", "bfloat16", ParallelContext(ep_rank=rank, ep_world=WORLD))
        blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
        assert blocks and all(b.experts.sliced and b.prepared is None for b in blocks)
        assert model.model.prepared is None
        whole = _load(checkpoints["k3_mx"], "k3_mx", "bfloat16")
        if whole.ops.name == "cpu-native":  # the plan this test keeps away exists on the backend
            assert all(m.prepared is not None for m in whole.modules() if isinstance(m, MoeBlock))
