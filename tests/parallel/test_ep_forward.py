"""Expert parallelism: routed experts split by expert across the tensor-parallel group (the rest as
under TP). Two gloo ranks, each reading only its own experts, give the unsharded model's fp32
logits (both families, bf16 and MXFP4 experts, packed and dequantized), and in bf16 the native
MoE blocks (and logits) match the reference backend on the same shards; a rank holds E/W whole
experts, 1/W of the expert bytes, and skipping the MoE combine breaks the logits. In-process:
rank layouts against the unsharded and TP ones, which tensors a rank reads, the local-experts
op, the E % W check."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltaserve.model.experts import StackedExperts
from deltaserve.model.fused import bound_ops, prepare_model
from deltaserve.model.kimi import KimiForCausalLM
from deltaserve.model.moe_layer import MoeBlock
from deltaserve.model.weights import load_model
from deltaserve.ops.backends.select import select_ops
from deltaserve.ops.backends.torch import REFERENCE, TorchOps
from deltaserve.ops.operands import ExpertWeights, GluAct
from deltaserve.parallel import ParallelContext, init_tensor_parallel
from deltaserve.parallel.loading import ShardReader
from tests.kernel_calls import count_kernel_calls
from tests.parallel.test_tp_forward import (
    CASES,
    _cached,
    _check_shards,
    _ids,
    _load,
    _NoReduce,
    _rel,
    checkpoints,  # noqa: F401 (fixture)
)

from .spawned import exit_worker

WORLD = 2
RUNS = [(name, "float32") for name, *_ in CASES] + [("k3_mx", "bfloat16"), ("kl", "bfloat16")]
# bf16 runs compare the backend `select_ops` binds (native where the library loads) with the
# reference on the same shards, block by block on the same inputs (the sharp check: these random
# tiny models amplify bf16 rounding of the attention kernels into flipped routing decisions) and,
# where the model does not flip one, on the logits
BF16_LOGITS = ("k3_mx",)
MOE_ROWS = (2, 24, 96)  # the fused decode kernel, and per-expert GEMMs past FUSED_MAX_TOKENS per rank
_EXPERT_FILE = re.compile(r"\.experts\.(\d+)\.")


def _ep(rank: int) -> ParallelContext:
    return ParallelContext(rank, WORLD, expert_parallel=True)


def _moe_blocks(model: torch.nn.Module) -> list[MoeBlock]:
    return [m for m in model.modules() if isinstance(m, MoeBlock)]


def _expert_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for n, t in tensors if ".experts." in n)


def _check_layout(model: KimiForCausalLM, rank: int) -> None:
    """Every MoE block holds experts [rank * E/W, (rank + 1) * E/W) at their full width."""
    m = model.config.moe
    n = m.num_experts // WORLD
    for moe in _moe_blocks(model):
        ex = moe.experts
        assert (ex.num_experts, ex.first, ex.width) == (n, rank * n, m.intermediate_size)
        for op in ex.weights().operands():
            assert all(t.shape[0] == n for t in (op if isinstance(op, tuple) else (op,)))


@torch.inference_mode()
def _moe_native_vs_reference(model: KimiForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Each MoE block on the input it saw in a forward, at MOE_ROWS rows, on the bound backend
    and on the reference: their relative differences. On the native backend the experts kernel
    runs, and the whole-block kernel (this rank's experts, the other pairs skipped) exactly where
    the block has no latent norm (with one, only the whole-stack step may run it)."""
    seen = []
    hooks = [moe.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0]))) for moe in _moe_blocks(model)]
    model.forward_full(ids)
    for h in hooks:
        h.remove()
    cases = [(moe, x.repeat(-(-rows // len(x)), 1)[:rows]) for moe, x in seen for rows in MOE_ROWS]
    with pytest.MonkeyPatch.context() as patch:
        calls = count_kernel_calls(patch, ["moe_experts", "moe_block"])
        bound = [moe(x) for moe, x in cases]
    if model.ops.name == "cpu-native":
        stack_only = {moe.prepared[2] for moe, _ in cases}
        assert len(stack_only) == 1 and calls["moe_experts"] > 0, (stack_only, calls)
        assert (calls["moe_block"] == 0) == stack_only.pop(), calls
    with bound_ops(model, REFERENCE):
        return torch.tensor([_rel(b.float(), moe(x).float()) for b, (moe, x) in zip(bound, cases)])


def _worker(rank: int, init_method: str, ckpts: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, WORLD, init_method, expert_parallel=True)
    try:
        ids = _ids()
        for name, dtype in RUNS:
            model = _load(ckpts[name], name, dtype, tp)
            _check_layout(model, rank)
            _check_shards(model, WORLD)
            got = {"logits": model.forward_full(ids), "bytes": torch.tensor(_expert_bytes(model))}
            if dtype == "bfloat16":
                norms = [hasattr(moe, "routed_expert_norm") for moe in _moe_blocks(model)]
                assert [moe.prepared[2] for moe in _moe_blocks(model)] == norms  # stack only where normed
                got["moe_rel"] = _moe_native_vs_reference(model, ids)
            if dtype == "bfloat16" and name in BF16_LOGITS:
                got["short"] = model.forward_full(ids[:2])
                with bound_ops(model, REFERENCE):
                    got["logits_reference"] = model.forward_full(ids)
                    got["short_reference"] = model.forward_full(ids[:2])
            if name == "k3":
                got["cached"] = _cached(model, ids)
                for moe in _moe_blocks(model):
                    moe.tp = _NoReduce(rank, WORLD, expert_parallel=True)
                got["broken"] = model.forward_full(ids)
            if rank == 0:
                meta = {"ops": model.ops.name}
                save_file({k: v.contiguous() for k, v in got.items()}, f"{out}/{name}_{dtype}.safetensors", meta)
        dist.barrier()  # no rank tears the group down while rank 0 still writes
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_ep_logits_match_unsharded(checkpoints, tmp_path):
    init = f"file://{tmp_path / 'store'}"
    args = (init, {k: str(v) for k, v in checkpoints.items()}, str(tmp_path))
    mp.start_processes(_worker, args=args, nprocs=WORLD, join=True, start_method="spawn")
    ids = _ids()
    for name, dtype in RUNS:
        path = str(tmp_path / f"{name}_{dtype}.safetensors")
        got = load_file(path)
        whole = _load(checkpoints[name], name, dtype)
        with safe_open(path, "pt") as f:
            assert f.metadata()["ops"] == whole.ops.name  # bf16: native on the ranks where it loads here
        assert got["bytes"].item() * WORLD == _expert_bytes(whole) > 0, name
        if dtype == "float32":
            ref = whole.forward_full(ids)
            assert _rel(got["logits"], ref) <= 1e-5, name
            assert torch.equal(got["logits"].argmax(-1), ref.argmax(-1)), name
        else:
            assert got["moe_rel"].max() <= 1e-2, (name, got["moe_rel"])
            for key in ("logits", "short") if name in BF16_LOGITS else ():
                assert _rel(got[key], got[f"{key}_reference"]) <= 1e-2, (name, key)
        if "cached" in got:
            assert _rel(got["cached"], ref) <= 1e-4, name
            assert _rel(got["broken"], ref) > 1e-2, name


def test_ep_rank_holds_its_experts_whole_and_reads_only_them(checkpoints, monkeypatch):
    """Rank r's experts are experts [r*E/W, (r+1)*E/W) of the unsharded model, whole (packed MXFP4
    stays packed); no other rank's expert tensor is read; everything else is the TP layout."""
    read: list[str] = []
    real = ShardReader.reader

    def recording(self, f, raw_name, name):
        thunk = real(self, f, raw_name, name)
        return lambda: (read.append(raw_name), thunk())[1]

    monkeypatch.setattr(ShardReader, "reader", recording)
    for name, dtype in (("k3", "float32"), ("k3_mx", "bfloat16")):
        whole = load_model(checkpoints[name], dtype, progress=False).state_dict()
        for rank in range(WORLD):
            read.clear()
            ep = load_model(checkpoints[name], dtype, progress=False, tp=_ep(rank))
            experts = {int(m.group(1)) for m in map(_EXPERT_FILE.search, read) if m}
            tp = load_model(checkpoints[name], dtype, progress=False, tp=ParallelContext(rank, WORLD)).state_dict()
            n = ep.config.moe.num_experts // WORLD
            assert experts == set(range(rank * n, (rank + 1) * n)), (name, rank, experts)
            routed = 0
            for key, t in ep.state_dict().items():
                if ".experts." in key:
                    routed += 1
                    assert torch.equal(t, whole[key][rank * n : (rank + 1) * n]), key
                    assert t.shape != tp[key].shape, key  # TP splits the width instead
                else:
                    assert torch.equal(t, tp[key]), key
            assert routed == 3 * len(_moe_blocks(ep)) * (2 if dtype == "bfloat16" else 1)


def test_every_rank_slice_reaches_prepare_experts(checkpoints):
    """A backend converting routed experts at load (the Triton backend's `triton_kernels` layout)
    is handed each rank's slice too, though a sliced block gets no whole-block plan."""

    class Recording(TorchOps):
        def __init__(self):
            self.seen: list[int] = []

        def prepare_experts(self, ex, act):
            self.seen.append(ex.num)

    model = load_model(checkpoints["k3_mx"], "bfloat16", progress=False, tp=_ep(1))
    ops = Recording()
    prepare_model(model, ops)
    blocks = _moe_blocks(model)
    assert blocks and all(m.experts.sliced and m.prepared is None for m in blocks)
    assert ops.seen == [model.config.moe.num_experts // WORLD] * len(blocks)


def test_local_experts_runs_only_local_pairs():
    """The ranks' `local_experts` partial sums add up to `experts` (fp32, reference), each rank
    computing exactly its pairs; bf16 on the native backend matches the reference per slice."""
    gen = torch.Generator().manual_seed(0)
    n, k, e, width, d = 9, 3, 8, 16, 24
    x = torch.randn(n, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=gen)
    w1, w3 = (torch.randn(e, width, d, generator=gen) * 0.1 for _ in range(2))
    w2 = torch.randn(e, d, width, generator=gen) * 0.1
    act = GluAct("silu")
    rows: list[int] = []

    class Counting(TorchOps):
        def experts(self, x, ids, weights, ex, act):
            rows.append(ids.numel())
            return super().experts(x, ids, weights, ex, act)

    full = REFERENCE.experts(x, ids, weights, ExpertWeights(w1, w3, w2), act)
    half = e // WORLD
    parts = []
    for rank in range(WORLD):
        lo = rank * half
        ex = ExpertWeights(w1[lo : lo + half], w3[lo : lo + half], w2[lo : lo + half])
        parts.append(Counting().local_experts(x, ids, weights, ex, act, lo))
        assert rows[-1] == ((ids >= lo) & (ids < lo + half)).sum().item()
        native = select_ops(torch.device("cpu"), torch.bfloat16)
        bf = [t.bfloat16() for t in (x, w1[lo : lo + half], w3[lo : lo + half], w2[lo : lo + half])]
        got = native.local_experts(bf[0], ids, weights, ExpertWeights(*bf[1:]), act, lo)
        want = REFERENCE.local_experts(bf[0], ids, weights, ExpertWeights(*bf[1:]), act, lo)
        assert _rel(got.float(), want.float()) <= 1e-2
    assert _rel(sum(parts), full) <= 1e-6
    assert sum(rows) == n * k


def test_experts_must_divide_by_the_ranks():
    with pytest.raises(ValueError, match="8 routed experts do not split evenly over 3 ranks"):
        StackedExperts(8, 32, 16, ParallelContext(0, 3, expert_parallel=True))
    ex = StackedExperts(8, 32, 16, ParallelContext(1, 4, expert_parallel=True))
    assert (tuple(ex.w1.shape), tuple(ex.w2.shape), ex.first, ex.sliced) == ((2, 32, 16), (2, 16, 32), 2, True)
    assert not StackedExperts(8, 32, 16, ParallelContext(0, 1, expert_parallel=True)).sliced
