"""Decode context parallelism: 2 gloo ranks (TP2 = DCP2), each caching only its positions of the
MLA latent rows, give the unsharded model's fp32 logits over a chunked multi-sequence prefill and
decode steps through the paged pools (both families); each rank's pool holds exactly its positions;
merging the partial attentions by plain sum instead of by LSE breaks the logits. Unit tests check
the partial-attention and LSE-merge ops against a float64 softmax."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from deltaserve.cache import ForwardBatch, KdaStatePool, MlaPagePool
from deltaserve.kernels.cpu.library import NativeKernels, native
from deltaserve.model.kimi import KimiForCausalLM
from deltaserve.model.mla_layer import DcpMlaAttention, MlaAttention
from deltaserve.model.weights import load_model
from deltaserve.ops import mla as mla_ops
from deltaserve.parallel import SINGLE, ParallelContext, init_tensor_parallel
from deltaserve.tiny import PRESETS, make_tiny

from .spawned import exit_worker
from .test_tp_forward import _WIDE, _rel

WORLD = DCP = 2
PAGE = 4  # logical page: PAGE // DCP rows per page on each rank
FAMILIES = ("kimi_k3", "kimi_linear")
# per sequence: two prefill chunks (ends 7, 11, 5: not page-aligned; the third starts with one
# token, whose query finds no key on DCP rank 1), then DECODE one-token steps
CHUNKS = ([4, 5, 1], [3, 6, 4])
DECODE = 3


def _ids(vocab: int) -> torch.Tensor:
    total = sum(sum(c) for c in CHUNKS) + DECODE * len(CHUNKS[0])
    return torch.randint(0, vocab, (total,), generator=torch.Generator().manual_seed(5))


def _pools(model: KimiForCausalLM, tp: ParallelContext) -> tuple[MlaPagePool, KdaStatePool]:
    """Pools for one rank (the model's dtype): MLA pages split by position under DCP, KDA state with
    the rank's heads."""
    cfg, k, dtype = model.config, model.config.kda, model.lm_head.weight.dtype
    mla = MlaPagePool(cfg.mla_layer_ids, 16, PAGE, cfg.mla.latent_dim, dtype, dcp_world=tp.dcp_world)
    tail = (k.conv_kernel - 1, 3 * k.proj_dim // tp.world)
    state = (k.num_heads // tp.world, k.head_dim, k.head_dim)
    return mla, KdaStatePool(cfg.kda_layer_ids, 4, tail, state, dtype, torch.float32)


@torch.inference_mode()
def _drive(model: KimiForCausalLM, tp: ParallelContext) -> tuple[torch.Tensor, MlaPagePool, list[list[int]]]:
    """Logits of every sequence's last token after each step: two prefill chunks, then decodes.
    Page tables are interleaved (pages of different sequences alternate)."""
    mla, kda = _pools(model, tp)
    steps = [*CHUNKS, *([[1] * len(CHUNKS[0])] * DECODE)]
    ends = [sum(s[b] for s in steps) for b in range(len(CHUNKS[0]))]
    order = [
        b for i in range(max(mla.pages_for(e) for e in ends)) for b in range(len(ends)) if mla.pages_for(ends[b]) > i
    ]
    pages = [[] for _ in ends]
    for b, p in zip(order, mla.allocate(len(order))):
        pages[b].append(p)
    slots = [kda.allocate() for _ in ends]
    ids, done, used, rows = _ids(model.config.vocab_size), [0] * len(ends), 0, []
    for new in steps:
        step_ids = ids[used : used + sum(new)]
        fb = ForwardBatch(step_ids, list(done), list(new), pages, slots, mla, kda, tp=tp)
        hidden = model(step_ids, fb.context())
        rows.append(model.compute_logits(hidden[fb.last_token_rows()]))
        used, done = used + sum(new), [d + n for d, n in zip(done, new)]
    return torch.stack(rows), mla, pages


def _native_partial(path: str, tp: ParallelContext) -> dict[str, torch.Tensor]:
    """bf16 on the native backend: each decode-step call of the partial attention kernel over the pool
    (`ops.mla_decode_partial`) beside `mla_absorbed_partial` over the rows it read, gathered (every
    row visible): the largest error of o (relative to its largest value) and of the finite lse, the
    count of calls and of shares without rows; and the logits of the steps."""
    model = load_model(path, "bfloat16", tp=tp, progress=False)
    errors = []
    real = NativeKernels.mla_decode_partial

    def checked(self, q, rows, read_rows, cu_kv, rank, scale):
        o, lse = real(self, q, rows, read_rows, cu_kv, rank, scale)
        n = len(cu_kv) - 1
        sees_all = torch.full((n,), 1 << 40)  # past every row (padding keys sit at the largest int64)
        ref_o, ref_lse = mla_ops.mla_absorbed_partial(
            q, rows[read_rows], sees_all, torch.zeros_like(read_rows), torch.arange(n + 1), cu_kv, rank, scale
        )
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite) and (o[~finite] == 0).all()
        errors.append(((o - ref_o).abs().max() / ref_o.abs().max()).item())
        errors.append((lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0)
        return o, lse

    with pytest.MonkeyPatch.context() as m:
        m.setattr(NativeKernels, "mla_decode_partial", checked)
        logits = _drive(model, tp)[0].float()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(model.ops), "mla_decode_partial", lambda *a: None)
        gathered = _drive(model, tp)[0].float()
    e = torch.tensor(errors).view(-1, 2)
    return {
        "logits": logits,
        "gathered": gathered,
        "o_error": e[:, 0].max(),
        "lse_error": e[:, 1].max(),
        "calls": torch.tensor(len(e)),
    }


def _sum_combine(o, lse):
    """A wrong merge: the plain sum of the parts (what forgetting the LSE weights gives)."""
    return o.float().sum(0), lse.float().amax(0)


def _worker(rank: int, init_method: str, ckpts: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, WORLD, init_method, dcp_world=DCP)
    try:
        for family, path in ckpts.items():
            model = load_model(path, "float32", tp=tp, progress=False)
            mla_layers = [m for m in model.modules() if isinstance(m, MlaAttention)]
            assert mla_layers and all(isinstance(m, DcpMlaAttention) and m.prepared is None for m in mla_layers)
            logits, mla, pages = _drive(model, tp)
            got = {"logits": logits, "storage": mla.storage, "pages": torch.tensor(sum(pages, []))}
            got["full"] = model.forward_full(_ids(model.config.vocab_size)[:9])
            if family == "kimi_k3":
                with pytest.MonkeyPatch.context() as m:
                    m.setattr(mla_ops, "lse_combine", _sum_combine)
                    got["broken"] = _drive(model, tp)[0]
            save_file({k: v.contiguous() for k, v in got.items()}, f"{out}/{family}_{rank}.safetensors")
            if family == "kimi_k3" and native() is not None:
                save_file(_native_partial(path, tp), f"{out}/native_{rank}.safetensors")
        dist.barrier()  # no rank tears the group down while the other still works (gloo aborts it)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    """Tiny checkpoints (heads divisible by 2) and the outputs of one 2-rank DCP run over both."""
    root = tmp_path_factory.mktemp("dcp")
    with pytest.MonkeyPatch.context() as m:
        for family in FAMILIES:
            m.setitem(PRESETS, (family, "dcp"), dataclasses.replace(PRESETS[(family, "tiny")], **_WIDE))
        ckpts = {family: make_tiny(root / family, family, "dcp", seed=11) for family in FAMILIES}
    args = (f"file://{root / 'store'}", {k: str(v) for k, v in ckpts.items()}, str(root))
    mp.start_processes(_worker, args=args, nprocs=WORLD, join=True, start_method="spawn")
    return ckpts, root


@pytest.mark.parametrize("family", FAMILIES)
def test_dcp_logits_match_unsharded(family, dcp_run):
    ckpts, root = dcp_run
    model = load_model(ckpts[family], "float32", progress=False)
    want, ref_pool, _ = _drive(model, SINGLE)
    ids = _ids(model.config.vocab_size)
    for rank in range(WORLD):
        got = load_file(str(root / f"{family}_{rank}.safetensors"))
        assert _rel(got["logits"], want) <= 1e-5, (family, rank, _rel(got["logits"], want))
        assert torch.equal(got["logits"].argmax(-1), want.argmax(-1)), (family, rank)
        assert _rel(got["full"], model.forward_full(ids[:9])) <= 1e-5, (family, rank)
        # rank r holds PAGE // DCP rows per page: exactly the rows of positions t % DCP == r
        storage = got["storage"]
        assert storage.shape == (*ref_pool.storage.shape[:2], PAGE // DCP, ref_pool.row_dim)
        mine = ref_pool.storage[:, :, rank::DCP]
        assert _rel(storage, mine) <= 1e-5, (family, rank)
        used = torch.zeros(storage.shape[1], dtype=torch.bool)
        used[got["pages"]] = True
        assert storage[:, ~used].abs().max() == 0 and storage[:, used].abs().amax(-1).gt(0).any()
        # unwritten positions (past each sequence's end, on any rank) are still zero in both
        assert torch.equal(storage == 0, mine == 0), (family, rank)


def test_dcp_decode_partial_on_the_native_kernel(dcp_run):
    """bf16: every decode step's partial attention ran on the native kernel over the pool in place (on
    every rank, each MLA layer), each call's (o, lse) those of the PyTorch partial over the same rows
    (o within its bf16 softmax weights: ~1 bf16 epsilon of its largest value), and the steps' logits
    those of the rows gathered for the PyTorch partial up to bf16 noise (~1 % here)."""
    if native() is None:
        pytest.skip("native CPU kernels unavailable")
    ckpts, root = dcp_run
    mla_layers = len(load_model(ckpts["kimi_k3"], "float32", progress=False).config.mla_layer_ids)
    for rank in range(WORLD):
        got = load_file(str(root / f"native_{rank}.safetensors"))
        assert int(got["calls"]) == DECODE * mla_layers
        assert got["o_error"] <= 1e-2 and got["lse_error"] <= 1e-5, (rank, got["o_error"], got["lse_error"])
        assert _rel(got["logits"], got["gathered"]) <= 5e-2, (rank, _rel(got["logits"], got["gathered"]))


def test_dcp_wrong_combine_breaks_logits(dcp_run):
    ckpts, root = dcp_run
    want = _drive(load_model(ckpts["kimi_k3"], "float32", progress=False), SINGLE)[0]
    got = load_file(str(root / "kimi_k3_0.safetensors"))
    assert _rel(got["broken"], want) > 1e-2


def _split_case(dcp: int, seed: int = 0):
    """Random absorbed-attention inputs for 3 sequences (one new chunk after a cached context, one
    decode, one fresh prompt) and, per DCP rank, the rows at its positions t % dcp == d."""
    g = torch.Generator().manual_seed(seed)
    rank, rope, heads, scale = 16, 4, 3, 0.37
    context, new = [0, 9, 5], [6, 1, 3]
    ends = [c + n for c, n in zip(context, new)]
    q = torch.randn(sum(new), heads, rank + rope, generator=g, dtype=torch.float64)
    kv = torch.randn(sum(ends), rank + rope, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, *new]).cumsum(0)
    q_pos = torch.cat([torch.arange(c, e) for c, e in zip(context, ends)])
    starts = [0, *torch.tensor(ends).cumsum(0).tolist()[:-1]]
    shares = []
    for d in range(dcp):
        pos = [torch.arange(d, e, dcp) for e in ends]
        rows = torch.cat([s + p for s, p in zip(starts, pos)])
        cu_kv = torch.tensor([0, *[len(p) for p in pos]]).cumsum(0)
        shares.append((kv[rows], torch.cat(pos), cu_kv))
    return q, kv, q_pos, cu_q, torch.tensor([0, *ends]).cumsum(0), shares, rank, scale


def _softmax64(q, kv, q_pos, kv_pos, seq_q, seq_kv, rank, scale):
    """float64 attention with an explicit [Nq, H, Nkv] score matrix: (o, lse), o = 0 / lse = -inf
    where a query sees nothing."""
    s = torch.einsum("nhd,kd->nhk", q, kv) * scale
    seen = (seq_q[:, None] == seq_kv[None]) & (kv_pos[None] <= q_pos[:, None])
    s = s.masked_fill(~seen[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return p @ kv[:, :rank], lse


def _seq_ids(cu: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())


def test_partial_and_combine_match_float64_softmax():
    q, kv, q_pos, cu_q, cu_kv, shares, rank, scale = _split_case(3)
    parts = []
    for rows, kv_pos, cu in shares:
        o, lse = mla_ops.mla_absorbed_partial(q.float(), rows.float(), q_pos, kv_pos, cu_q, cu, rank, scale)
        ref_o, ref_lse = _softmax64(q, rows, q_pos, kv_pos, _seq_ids(cu_q), _seq_ids(cu), rank, scale)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        assert (o[torch.isinf(lse)] == 0).all()
        torch.testing.assert_close(o.double(), ref_o, rtol=0, atol=1e-5)
        finite = torch.isfinite(lse)
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=0, atol=1e-5)
        parts.append((o, lse))
    assert torch.isinf(parts[-1][1]).any(), "some query sees no key on the last share"
    o, lse = mla_ops.lse_combine(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    kv_pos = torch.cat([torch.arange(int(n)) for n in cu_kv.diff()])
    ref_o, ref_lse = _softmax64(q, kv, q_pos, kv_pos, _seq_ids(cu_q), _seq_ids(cu_kv), rank, scale)
    torch.testing.assert_close(o.double(), ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)
    wrong = torch.stack([p[0] for p in parts]).sum(0)
    assert (wrong.double() - ref_o).abs().max() > 0.1


def test_partial_over_whole_context_is_absorbed_attention():
    q, kv, q_pos, cu_q, cu_kv, shares, rank, scale = _split_case(1, seed=1)
    rows, kv_pos, cu = shares[0]
    o, lse = mla_ops.mla_absorbed_partial(q.float(), rows.float(), q_pos, kv_pos, cu_q, cu, rank, scale)
    want = mla_ops.mla_absorbed_attention(q.float(), kv.float(), cu_q, cu_kv, rank, scale)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(o, want, rtol=0, atol=1e-5)


def test_lse_combine_of_empty_parts():
    o = torch.randn(2, 3, 2, 4)
    lse = torch.full((2, 3, 2), float("-inf"))
    lse[0, 1] = 0.5
    merged, total = mla_ops.lse_combine(torch.where(torch.isinf(lse)[..., None], 0.0, o), lse)
    assert torch.equal(merged[1], o[0, 1]) and total[1].eq(0.5).all()
    assert (merged[[0, 2]] == 0).all() and torch.isneginf(total[[0, 2]]).all()


def test_dcp_pool_and_batch_layout():
    with pytest.raises(ValueError):
        MlaPagePool([0], 2, 5, 3, torch.float32, dcp_world=2)
    assert MlaPagePool.bytes_per_page(2, 8, 3, torch.float32, dcp_world=4) * 4 == MlaPagePool.bytes_per_page(
        2, 8, 3, torch.float32
    )
    mla = MlaPagePool([0], 4, 4, 3, torch.float32, dcp_world=2)
    kda = KdaStatePool([1], 2, (1, 3), (1, 2, 2), torch.float32)
    tp = ParallelContext(1, 2, dcp_world=2)  # DCP rank 1: odd positions
    fb = ForwardBatch(torch.zeros(6, dtype=torch.long), [3, 0], [4, 2], [[2, 0], [3]], [0, 1], mla, kda, tp=tp)
    # sequence 0 writes positions 3, 5 (step rows 0, 2); sequence 1 writes position 1 (step row 5)
    assert fb.write_src.tolist() == [0, 2, 5]
    assert fb.write_rows.tolist() == [2 * 2 + 1, 0 * 2 + 0, 3 * 2 + 0]
    assert fb.read_rows.tolist() == [4, 5, 0, 6] and fb.kv_pos.tolist() == [1, 3, 5, 1]
    assert fb.cu_kv.tolist() == [0, 3, 4] and fb.q_pos.tolist() == [3, 4, 5, 6, 0, 1]
    with pytest.raises(RuntimeError):
        fb.mla_context(0)
    with pytest.raises(ValueError):
        ForwardBatch(torch.zeros(1, dtype=torch.long), [0], [1], [[0]], [0], mla, kda)
