"""Shared-memory collectives between the ranks of one machine: the same sums and gathers as gloo
(identical on every rank), larger tensors left to gloo, nothing left in /dev/shm, and a wait that
ends with an error when a rank never arrives or is declared dead."""

from __future__ import annotations

import glob
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from deltaserve.parallel import init_tensor_parallel

from .spawned import exit_worker

SLOT = 1 << 16


def _worker(rank: int, world: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, world, init, timeout_s=30, shm_slot_bytes=SLOT)
    try:
        assert tp.shm is not None
        tp.shm.timeout_s = 0.5
        g = torch.Generator().manual_seed(rank)
        got = {}
        for i, dtype in enumerate((torch.float32, torch.bfloat16)):
            x = torch.randn(3, 40, generator=g).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            got[f"sum{i}"], got[f"ref{i}"] = tp.all_reduce(x.clone()), ref
            got[f"gather{i}"] = tp.all_gather(x, dim=-1)
        big = torch.ones(SLOT // 4 + 1)
        assert not tp.shm.fits(big) and torch.equal(tp.all_reduce(big), torch.full_like(big, world))
        if rank == 0:  # rank 1 skips this one: rank 0 must time out, not hang
            t0 = time.monotonic()
            try:
                tp.shm.all_reduce(torch.ones(4))
            except RuntimeError as e:
                got["timeout_s"] = torch.tensor([time.monotonic() - t0])
                assert "within 0.5 s" in str(e)
            tp.shm.abort("rank 1 died")
            try:
                tp.shm.all_reduce(torch.ones(4))
            except RuntimeError as e:
                assert "rank 1 died" in str(e)
                got["aborted"] = torch.ones(1)
        save_file({k: v.contiguous() for k, v in got.items()}, f"{out}/rank{rank}.safetensors")
    finally:
        dist.barrier()
        dist.destroy_process_group()
    exit_worker()


def test_shared_memory_collectives(tmp_path):
    world = 2
    before = set(glob.glob("/dev/shm/deltaserve-*"))
    args = (world, f"file://{tmp_path / 'store'}", str(tmp_path))
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="spawn")
    assert set(glob.glob("/dev/shm/deltaserve-*")) == before
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(world)]
    for i in range(2):
        assert torch.equal(ranks[0][f"sum{i}"], ranks[1][f"sum{i}"])  # the same sum on every rank
        tol = 1e-6 if i == 0 else 1e-2
        assert torch.allclose(ranks[0][f"sum{i}"].float(), ranks[0][f"ref{i}"].float(), atol=tol)
        assert torch.equal(ranks[0][f"gather{i}"], ranks[1][f"gather{i}"])
        assert ranks[0][f"gather{i}"].shape == (3, 80)
    assert 0.4 < ranks[0]["timeout_s"].item() < 5 and ranks[0]["aborted"].item() == 1


def test_no_segment_is_left_when_the_rendezvous_fails(tmp_path, monkeypatch):
    """A rank that dies between the segment's creation and the barrier (here: the barrier fails)
    leaves nothing in /dev/shm: rank 0 unlinks the name whatever happens."""
    from deltaserve.parallel.shm import ShmCollectives

    before = set(glob.glob("/dev/shm/deltaserve-*"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:

        def dead_peer(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")

        monkeypatch.setattr(dist, "barrier", dead_peer)
        try:
            ShmCollectives.create(0, 1, SLOT, 5.0)
        except RuntimeError as e:
            assert "reset by peer" in str(e)
        else:
            raise AssertionError("the failed barrier must surface")
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert set(glob.glob("/dev/shm/deltaserve-*")) == before
