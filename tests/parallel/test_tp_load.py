"""Per-rank loading without a process group (loading runs no collective): each rank's tensors
are exactly its chunks of the unsharded model's (MXFP4 experts padded to whole groups), and dims
that do not split are refused."""

from __future__ import annotations

import pytest
import torch

from deltaserve.model.weights import load_model
from deltaserve.parallel import ParallelContext
from deltaserve.tiny import make_tiny


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3"), "kimi_k3", seed=2)


def _tensors(model):
    return dict([*model.named_parameters(), *model.named_buffers()])


def test_rank_tensors_are_chunks_of_the_whole(k3):
    """tiny K3 (2 KDA and MLA heads, bf16 experts of width 32): rank r's tensor is chunk r."""
    whole = _tensors(load_model(k3, torch.float32, progress=False))
    for rank in range(2):
        part = _tensors(load_model(k3, torch.float32, progress=False, tp=ParallelContext(rank, 2)))
        assert part.keys() == whole.keys()
        split = 0
        for name, t in part.items():
            w = whole[name]
            dims = [i for i, (a, b) in enumerate(zip(t.shape, w.shape)) if a != b]
            if dims:
                (d,) = dims
                split += 1
                w = w.narrow(d, rank * t.shape[d], t.shape[d])
            assert torch.equal(t, w), name
        assert split > 40


@pytest.mark.parametrize("moe_weights", ["packed", "dequantized"])
def test_mxfp4_experts_pad_to_whole_groups_per_rank(tmp_path, moe_weights):
    """MXFP4 experts split by whole 32-element groups: width 32 over 2 ranks is a group each, rank
    0's the checkpoint's whole width and rank 1's zeros (exact: zero columns add nothing)."""
    ckpt = make_tiny(tmp_path, "kimi_k3", mxfp4=True, seed=2)
    whole = _tensors(load_model(ckpt, torch.bfloat16, progress=False, moe_weights=moe_weights))
    for rank in range(2):
        tp = ParallelContext(rank, 2)
        part = _tensors(load_model(ckpt, torch.bfloat16, progress=False, moe_weights=moe_weights, tp=tp))
        experts = {n: t for n, t in part.items() if ".experts." in n}
        assert len(experts) >= 3
        for name, t in experts.items():
            assert t.shape == whole[name].shape, name
            assert torch.equal(t, whole[name]) if rank == 0 else not t.any(), name


def test_context_checks():
    with pytest.raises(ValueError, match="rank 2 outside"):
        ParallelContext(2, 2)
    with pytest.raises(ValueError, match="KDA heads \\(3\\) does not divide"):
        ParallelContext(0, 2).split(3, "KDA heads")
    x = torch.ones(3)
    assert ParallelContext().all_reduce(x) is x
