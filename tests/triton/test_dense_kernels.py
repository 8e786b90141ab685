"""The dense Triton kernels (`ops.backends.triton_dense.TritonDenseOps`) against the reference ops, in fp32 on
tiny shapes: under TRITON_INTERPRET=1 on CPU, or on CUDA where a GPU is present."""

import pytest
import torch

from .common import DEVICE, KERNEL_MARKS, close, cuda_only

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from deltaserve.cache.forward_batch import MlaRowsView  # noqa: E402
from deltaserve.kernels.triton.mla import mla_decode_attention  # noqa: E402
from deltaserve.kernels.triton.moe import _tanh  # noqa: E402
from deltaserve.ops.backends.torch import REFERENCE  # noqa: E402
from deltaserve.ops.backends.triton_dense import TritonDenseOps, runs_here  # noqa: E402
from deltaserve.ops.mla import mla_absorbed_attention  # noqa: E402
from deltaserve.ops.mxfp4 import mxfp4_decode  # noqa: E402
from deltaserve.ops.operands import ExpertWeights, GluAct, RouteSpec  # noqa: E402
from deltaserve.ops.reference.dense import (  # noqa: E402
    naive_attn_res_mix,
    naive_grouped_experts,
    naive_mla_absorbed_attention,
    naive_rms_norm,
    naive_route,
)

pytestmark = KERNEL_MARKS
OPS = TritonDenseOps()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dev(*ts):
    out = tuple(t.to(DEVICE) for t in ts)
    assert runs_here(*out)
    return out


# ---------------------------------------------------------------- norms and AttnRes


def test_rms_norm_any_leading_shape():
    g = _gen(0)
    x, w = torch.randn(2, 3, 40, generator=g), torch.randn(40, generator=g)
    (xd, wd) = _dev(x, w)
    close(OPS.rms_norm(xd, wd, 1e-6), naive_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("then", [False, True])
def test_attn_res_mix_and_norm(depth, then):
    g = _gen(depth)
    n, d = 5, 40
    cur = torch.randn(n, d, generator=g)
    bank = [torch.randn(n, d, generator=g) * (s + 1) for s in range(depth)]
    proj, norm, w = (torch.randn(d, generator=g) for _ in range(3))
    ref = naive_attn_res_mix(cur, bank, proj, norm)
    if then:
        ref = naive_rms_norm(ref, w, 1e-6)
    curd, projd, normd, wd, *bankd = _dev(cur, proj, norm, w, *bank)
    got = OPS.attn_res(curd, bankd, projd, normd, None, (wd, 1e-6, None) if then else None)
    close(got, ref)


# ---------------------------------------------------------------- router


@pytest.mark.parametrize(
    "e, spec, bias",
    [
        (16, RouteSpec(4, routed_scaling_factor=2.5), True),
        (32, RouteSpec(6, num_expert_group=4, topk_group=2, routed_scaling_factor=1.5), True),
        (24, RouteSpec(3, num_expert_group=8, topk_group=3), True),
        (12, RouteSpec(2, num_expert_group=12, topk_group=4), True),
        (20, RouteSpec(5, renormalize=False, routed_scaling_factor=0.5), False),
        (16, RouteSpec(3, num_expert_group=2, topk_group=1, bias_in_weights=True), True),
    ],
)
def test_route_matches_naive_router(e, spec, bias):
    g = _gen(e)
    x, gate = torch.randn(9, 24, generator=g), torch.randn(e, 24, generator=g)
    b = torch.randn(e, generator=g) * 0.5 if bias else None
    down = torch.randn(8, 24, generator=g)
    ref_w, ref_ids = naive_route(x, gate, b, *spec.args())
    xd, gated, downd = _dev(x, gate, down)
    weights, ids, z = OPS.route(xd, gated, None if b is None else b.to(DEVICE), spec, downd)
    assert torch.equal(ids.cpu(), ref_ids)
    close(weights, ref_w)
    close(z, x @ down.T)


def test_route_falls_back_where_the_kernel_does_not_apply():
    g = _gen(3)
    x, gate = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)
    spec = RouteSpec(2)
    got = OPS.route(x, gate, None, spec)
    ref = REFERENCE.route(x, gate, None, spec)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])


# ---------------------------------------------------------------- MXFP4 routed experts


def _packed(g, e, o, i):
    packed = torch.randint(0, 256, (e, o, i // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 126, (e, o, i // 32), generator=g, dtype=torch.uint8)
    return packed, scale


def _decoded(pair):
    return torch.stack([mxfp4_decode(p, s, torch.float32) for p, s in zip(*pair)])


ACTS = {
    "situ": GluAct("situ", 2.0, 3.0),
    "situ-nolin": GluAct("situ", 1.5, None),
    "silu": GluAct("silu"),
}


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("packed", [True, False])
def test_experts_match_naive_grouped_experts(act, packed):
    g = _gen(7 + packed)
    n, k, e = 7, 3, 6
    d, inter = (96, 64) if packed else (40, 24)
    x = torch.randn(n, d, generator=g)
    # experts 4 and 5 get no tokens; the others several each
    ids = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    if packed:
        w1, w3, w2 = _packed(g, e, inter, d), _packed(g, e, inter, d), _packed(g, e, d, inter)
        dense = [_decoded(w) for w in (w1, w3, w2)]
        ex = ExpertWeights(*(tuple(_dev(*w)) for w in (w1, w3, w2)), dtype=torch.float32)
    else:
        dense = [torch.randn(e, inter, d, generator=g) * 0.3 for _ in range(2)]
        dense.append(torch.randn(e, d, inter, generator=g) * 0.3)
        ex = ExpertWeights(*_dev(*dense))
    ref = naive_grouped_experts(x, ids, weights, *dense, ACTS[act])
    xd, idsd, wd = _dev(x, ids, weights)
    close(OPS.experts(xd, idsd, wd, ex, ACTS[act]), ref)


def test_experts_read_strided_weights_in_place():
    g = _gen(13)
    n, k, e, d, inter = 5, 2, 4, 64, 32
    x = torch.randn(n, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    act = ACTS["situ"]
    # packed: every other expert of a larger stack, codes padded per row
    pairs = [_packed(g, 2 * e, o, 2 * i) for o, i in ((inter, d), (inter, d), (d, inter))]
    views = [(p[::2, :, : i // 2], s[::2, :, : i // 32]) for (p, s), i in zip(pairs, (d, d, inter))]
    assert not views[0][0].is_contiguous()
    ref = naive_grouped_experts(x, ids, weights, *(_decoded(v) for v in views), act)
    ex = ExpertWeights(*(tuple(_dev(*v)) for v in views), dtype=torch.float32)
    close(OPS.experts(*_dev(x, ids, weights), ex, act), ref)
    # dense: transposed storage
    w1, w3 = (torch.randn(e, d, inter, generator=g).transpose(1, 2) for _ in range(2))
    w2 = torch.randn(e, inter, d, generator=g).transpose(1, 2)
    ref = naive_grouped_experts(x, ids, weights, w1, w3, w2, act)
    close(OPS.experts(*_dev(x, ids, weights), ExpertWeights(*_dev(w1, w3, w2)), act), ref)


def test_local_experts_run_the_kernel_on_the_rank_share():
    g = _gen(11)
    n, k, e, d, inter = 6, 2, 8, 64, 32
    x = torch.randn(n, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    pairs = [_packed(g, 3, inter, d), _packed(g, 3, inter, d), _packed(g, 3, d, inter)]
    act = ACTS["situ"]
    ref = REFERENCE.local_experts(x, ids, weights, ExpertWeights(*pairs, dtype=torch.float32), act, 2)
    ex = ExpertWeights(*(tuple(_dev(*w)) for w in pairs), dtype=torch.float32)
    close(OPS.local_experts(*_dev(x, ids, weights), ex, act, 2), ref)


@triton.jit
def _tanh_probe(x, y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y + offs, _tanh(tl.load(x + offs)))


def test_tanh_is_accurate_to_a_few_ulp():
    x = torch.cat([torch.logspace(-8, 1.5, 127), torch.zeros(1)])
    x = torch.cat([x, -x])
    (xd,) = _dev(x)
    y = torch.empty_like(xd)
    _tanh_probe[(1,)](xd, y, N=x.numel())
    torch.testing.assert_close(y.cpu(), torch.tanh(x), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- paged absorbed MLA decode


def _mla_case(seed, ctx_lens, heads=3, rank=24, rope=8, nope=8, v=6, page=4, num_pages=40):
    g = _gen(seed)
    rows = torch.randn(num_pages * page, rank + rope, generator=g)
    perm = torch.randperm(num_pages, generator=g)
    width = max(-(-c // page) for c in ctx_lens)
    table = perm[: len(ctx_lens) * width].view(len(ctx_lens), width)
    pos = [torch.arange(c) for c in ctx_lens]
    read_rows = torch.cat([table[b, p // page] * page + p % page for b, p in enumerate(pos)])
    cu_kv = torch.tensor([0, *ctx_lens]).cumsum(0)
    q = torch.randn(len(ctx_lens), heads, nope + rope, generator=g)
    w_uk = torch.randn(heads, nope, rank, generator=g) * 0.3
    w_uv = torch.randn(heads, v, rank, generator=g)
    return rows, table, read_rows, cu_kv, q, w_uk, w_uv


def _absorbed_ref(rows, read_rows, cu_kv, q, w_uk, w_uv, rank, scale):
    nope = w_uk.shape[1]
    q_lat = torch.cat([torch.einsum("nhd,hdr->nhr", q[..., :nope], w_uk), q[..., nope:]], -1)
    cu_q = torch.arange(q.shape[0] + 1)
    o_lat = naive_mla_absorbed_attention(q_lat, rows[read_rows], cu_q, cu_kv, rank, scale)
    return q_lat, o_lat, torch.einsum("nhr,hvr->nhv", o_lat, w_uv)


@pytest.mark.parametrize("ctx_lens", [[1], [5, 9, 16, 2], [33, 1, 20]])
def test_mla_decode_over_the_pool_rows(ctx_lens):
    rows, _, read_rows, cu_kv, q, w_uk, w_uv = _mla_case(len(ctx_lens), ctx_lens)
    scale = 16**-0.5
    _, _, ref = _absorbed_ref(rows, read_rows, cu_kv, q, w_uk, w_uv, 24, scale)
    qd, ukd, uvd, rowsd, rr, cu = _dev(q, w_uk, w_uv, rows, read_rows, cu_kv)
    got = OPS.mla_decode(qd, ukd, uvd, (rowsd, rr, cu), 24, scale)
    close(got, ref)


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_block_table_and_splits(splits):
    ctx_lens = [13, 3, 30, 7]
    rows, table, read_rows, cu_kv, q, w_uk, w_uv = _mla_case(5, ctx_lens, heads=20, rank=32, page=8, num_pages=24)
    scale = 0.2
    q_lat, o_lat, _ = _absorbed_ref(rows, read_rows, cu_kv, q, w_uk, w_uv, 32, scale)
    q_latd, rowsd, tabled, cu_kvd, read_rowsd = _dev(q_lat, rows, table, cu_kv, read_rows)
    paged = mla_decode_attention(q_latd, rowsd, cu_kvd, 32, scale, block_table=tabled, page_size=8, splits=splits)
    close(paged, o_lat)
    flat = mla_decode_attention(q_latd, rowsd, cu_kvd, 32, scale, read_rows=read_rowsd, splits=splits)
    close(flat, o_lat)


def test_mla_decode_takes_the_views_page_table():
    """A view with a page table (the engine's `MlaRowsView`) runs the paged kernel and never asks
    for the flat row list (O(context) to plan and send each step)."""
    rows, table, read_rows, cu_kv, q, w_uk, w_uv = _mla_case(5, [13, 3, 30, 7], heads=20, rank=32, page=8, num_pages=24)
    _, _, ref = _absorbed_ref(rows, read_rows, cu_kv, q, w_uk, w_uv, 32, 0.2)
    qd, ukd, uvd, rowsd, tabled, cu = _dev(q, w_uk, w_uv, rows, table, cu_kv)

    class NoFlatRows:
        @property
        def read_rows(self):
            raise AssertionError("the flat rows were planned")

    view = MlaRowsView(rowsd, cu, tabled, 8, NoFlatRows())
    close(OPS.mla_decode(qd, ukd, uvd, view, 32, 0.2), ref)


def test_mla_decode_without_rope_part():
    rows, _, read_rows, cu_kv, q, w_uk, w_uv = _mla_case(9, [6, 11], rope=0)
    _, _, ref = _absorbed_ref(rows, read_rows, cu_kv, q, w_uk, w_uv, 24, 0.3)
    qd, ukd, uvd, rowsd, rr, cu = _dev(q, w_uk, w_uv, rows, read_rows, cu_kv)
    close(OPS.mla_decode(qd, ukd, uvd, (rowsd, rr, cu), 24, 0.3), ref)


def test_describe_names_the_triton_families():
    described = OPS.describe()
    assert described["moe"] == "triton" and described["attn_res"] == "triton"
    assert described["kda"] == "torch"


# ---------------------------------------------------------------- bf16 on CUDA (the interpreter's bf16 dot is wrong)


def _close_bf16(got, ref):
    close(got.float(), ref.float(), rtol=2e-2)


@cuda_only
def test_bf16_norm_attn_res_and_router_on_cuda():
    g = _gen(21)
    cur, w = torch.randn(6, 7168, generator=g), torch.randn(7168, generator=g)
    bank = [torch.randn(6, 7168, generator=g) for _ in range(5)]
    proj, norm = torch.randn(7168, generator=g), torch.randn(7168, generator=g)
    curd, wd, projd, normd, *bankd = (t.to(DEVICE, torch.bfloat16) for t in (cur, w, proj, norm, *bank))
    then = (wd, 1e-6, None)
    _close_bf16(OPS.rms_norm(curd, wd, 1e-6), REFERENCE.rms_norm(curd, wd, 1e-6))
    _close_bf16(
        OPS.attn_res(curd, bankd, projd, normd, None, then), REFERENCE.attn_res(curd, bankd, projd, normd, None, then)
    )
    x, gate, bias = torch.randn(33, 256, generator=g), torch.randn(896, 256, generator=g), torch.randn(896, generator=g)
    spec = RouteSpec(8, num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)
    xd, gated, biasd = x.to(DEVICE, torch.bfloat16), gate.to(DEVICE, torch.bfloat16), bias.to(DEVICE)
    got, ref = OPS.route(xd, gated, biasd, spec), REFERENCE.route(xd, gated, biasd, spec)
    assert torch.equal(got[1], ref[1])
    close(got[0], ref[0])


@cuda_only
@pytest.mark.parametrize("n", [3, 600])
def test_bf16_mxfp4_situ_experts_on_cuda(n):
    g = _gen(22)
    k, e, d, inter = 8, 64, 256, 128
    x = torch.randn(n, d, generator=g).to(DEVICE, torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEVICE)
    weights = torch.rand(n, k, generator=g).to(DEVICE)
    pairs = [_packed(g, e, inter, d), _packed(g, e, inter, d), _packed(g, e, d, inter)]
    ex = ExpertWeights(*(tuple(t.to(DEVICE) for t in w) for w in pairs), dtype=torch.bfloat16)
    act = GluAct("situ", 4.0, 25.0)
    _close_bf16(OPS.experts(x, ids, weights, ex, act), REFERENCE.experts(x, ids, weights, ex, act))


@cuda_only
def test_bf16_mla_decode_on_cuda():
    ctx_lens = [700, 33, 1, 2048]
    rows, _, read_rows, cu_kv, q, w_uk, w_uv = _mla_case(
        23, ctx_lens, heads=64, rank=512, rope=64, nope=128, v=128, page=16, num_pages=256
    )
    rows, q, w_uk, w_uv = (t.to(DEVICE, torch.bfloat16) for t in (rows, q, w_uk, w_uv))
    read_rows, cu_kv = read_rows.to(DEVICE), cu_kv.to(DEVICE)
    scale = 192**-0.5
    got = OPS.mla_decode(q, w_uk, w_uv, (rows, read_rows, cu_kv), 512, scale)
    q_lat = torch.cat([torch.einsum("nhd,hdr->nhr", q[..., :128], w_uk), q[..., 128:]], -1)
    cu_q = torch.arange(len(ctx_lens) + 1, device=DEVICE)
    o_lat = mla_absorbed_attention(q_lat, rows[read_rows], cu_q, cu_kv, 512, scale)
    _close_bf16(got, torch.einsum("nhr,hvr->nhv", o_lat, w_uv))
