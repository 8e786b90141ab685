"""The MLA prefill and extend kernels (`kernels.triton.mla_prefill`, through `TritonDenseOps`) against the
naive per-query references: fp32 under TRITON_INTERPRET=1 on CPU (or CUDA), bf16 on CUDA only."""

import pytest
import torch

from .common import DEVICE, KERNEL_MARKS, close, cuda_only

pytest.importorskip("triton")

from deltaserve.cache.forward_batch import MlaRowsView  # noqa: E402
from deltaserve.kernels.extern import flash_prefill, flashinfer_mla  # noqa: E402
from deltaserve.kernels.triton.mla import mla_decode_attention  # noqa: E402
from deltaserve.kernels.triton.mla_prefill import mla_extend_attention, mla_prefill_attention  # noqa: E402
from deltaserve.ops.backends.torch import REFERENCE  # noqa: E402
from deltaserve.ops.backends.triton_dense import TritonDenseOps  # noqa: E402
from deltaserve.ops.reference.dense import naive_mla_absorbed_attention, naive_mla_prefill_attention  # noqa: E402

pytestmark = KERNEL_MARKS
OPS = TritonDenseOps()


def _prefill_case(seed, lens, heads, nope, rope, v_dim, rank=10):
    """q, and k_nope / v / k_rot as the layer slices them out of its projections (strided views)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, heads, nope + rope, generator=g)
    kv = torch.randn(n, heads, nope + v_dim, generator=g)
    latent = torch.randn(n, rank + rope, generator=g)
    cu = torch.tensor([0, *lens]).cumsum(0)
    return q, kv, latent, cu


def _prefill_ref(q, kv, latent, cu, nope, rank, scale):
    n, h = kv.shape[:2]
    k = torch.cat([kv[..., :nope], latent[:, None, rank:].expand(n, h, latent.shape[1] - rank)], -1)
    return naive_mla_prefill_attention(q, k, kv[..., nope:], cu, scale)


@pytest.mark.parametrize(
    "lens, heads, nope, rope, v_dim",
    [([5, 17, 1, 40], 3, 8, 4, 6), ([70], 2, 16, 8, 16), ([3, 9], 4, 8, 0, 8)],
)
def test_prefill_reads_key_parts_in_place(lens, heads, nope, rope, v_dim):
    q, kv, latent, cu = _prefill_case(len(lens), lens, heads, nope, rope, v_dim)
    ref = _prefill_ref(q, kv, latent, cu, nope, 10, 0.3)
    qd, kvd, latd, cud = (t.to(DEVICE) for t in (q, kv, latent, cu))
    got = OPS.mla_prefill(qd, kvd[..., :nope], latd[:, 10:], kvd[..., nope:], cud, 0.3)
    close(got, ref)
    torch.testing.assert_close(
        REFERENCE.mla_prefill(q, kv[..., :nope], latent[:, 10:], kv[..., nope:], cu, 0.3), ref, rtol=1e-5, atol=1e-5
    )


def test_flash_prefill_glue_against_a_strict_fake(monkeypatch):
    """The arguments handed to torch's varlen flash kernel (a fake here, checking its contract and
    computing causal attention from exactly what it was given) give the reference result."""
    lens, nope, rope, v_dim = [5, 17, 1], 8, 4, 6
    q, kv, latent, cu = _prefill_case(3, lens, 3, nope, rope, v_dim)
    seen = []

    def fake(query, key, value, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        assert query.shape == key.shape == value.shape and all(t.stride(-1) == 1 for t in (query, key, value))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        assert (max_q, max_k, window_size) == (max(lens), max(lens), (-1, 0)) and type(max_q) is int
        seen.append(query.shape)
        return naive_mla_prefill_attention(query, key, value, cu_q.long(), scale)

    monkeypatch.setattr(flash_prefill, "_varlen_attn", lambda: fake)
    got = flash_prefill.prefill(q, kv[..., :nope], latent[:, 10:], kv[..., nope:], cu, 0.3)
    close(got, _prefill_ref(q, kv, latent, cu, nope, 10, 0.3))
    assert seen == [(sum(lens), 3, nope + rope)]  # v padded to the q/k width, not the other way
    assert not flash_prefill.fits(q, v_dim)  # CPU
    assert not flash_prefill.fits(q.to(torch.bfloat16), 512)  # too wide for the kernel


def _extend_case(seed, ctx_lens, new_lens, heads, rank=24, rope=8, page=4, num_pages=48):
    """Pool rows, a permuted block table, the flat rows of each whole context, cu_q, cu_kv, q_latent."""
    g = torch.Generator().manual_seed(seed)
    ends = [c + n for c, n in zip(ctx_lens, new_lens)]
    rows = torch.randn(num_pages * page, rank + rope, generator=g)
    width = max(-(-e // page) for e in ends)
    table = torch.randperm(num_pages, generator=g)[: len(ends) * width].view(len(ends), width)
    read_rows = torch.cat(
        [table[b, torch.arange(e) // page] * page + torch.arange(e) % page for b, e in enumerate(ends)]
    )
    cu_q, cu_kv = torch.tensor([0, *new_lens]).cumsum(0), torch.tensor([0, *ends]).cumsum(0)
    q_lat = torch.randn(sum(new_lens), heads, rank + rope, generator=g)
    return rows, table, read_rows, cu_q, cu_kv, q_lat


@pytest.mark.parametrize(
    "ctx_lens, new_lens, heads, rope",
    [([3, 0, 10, 7], [2, 5, 1, 9], 20, 8), ([0], [23], 3, 8), ([30, 1], [1, 1], 5, 0), ([12], [40], 16, 8)],
)
def test_extend_over_pages_matches_the_per_query_reference(ctx_lens, new_lens, heads, rope):
    """Fresh sequences (no context), a decode row beside a chunk, two head blocks, no rope part."""
    rows, table, read_rows, cu_q, cu_kv, q_lat = _extend_case(sum(new_lens), ctx_lens, new_lens, heads, rope=rope)
    ref = naive_mla_absorbed_attention(q_lat, rows[read_rows], cu_q, cu_kv, 24, 0.2)
    args = [t.to(DEVICE) for t in (q_lat, rows, table)]
    got = mla_extend_attention(*args, 4, cu_q.to(DEVICE), cu_kv.to(DEVICE), 24, 0.2)
    close(got, ref)


def test_a_steps_layers_plan_their_tiles_once(monkeypatch):
    """Every MLA layer of a step passes the same boundaries: the tile plan is made (and sent) once."""
    from deltaserve.kernels.triton import mla_prefill as kernels

    sent, real = [], kernels.to_device

    def counted(host, device):
        sent.append(1)
        return real(host, device)

    monkeypatch.setattr(kernels, "to_device", counted)
    rows, table, read_rows, cu_q, cu_kv, q_lat = _extend_case(3, [5, 2], [3, 4], heads=4)
    args = [t.to(DEVICE) for t in (q_lat, rows, table)]
    cu_qd, cu_kvd = cu_q.to(DEVICE), cu_kv.to(DEVICE)
    first = mla_extend_attention(*args, 4, cu_qd, cu_kvd, 24, 0.2)
    close(mla_extend_attention(*args, 4, cu_qd, cu_kvd, 24, 0.2), first)
    assert len(sent) == 1
    mla_extend_attention(*args, 4, cu_q.clone().to(DEVICE), cu_kvd, 24, 0.2)  # the next step's boundaries
    assert len(sent) == 2


def test_extend_through_the_view_never_plans_flat_rows():
    rows, table, read_rows, cu_q, cu_kv, q_lat = _extend_case(7, [13, 0, 6], [4, 3, 1], heads=4)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(q_lat.shape[0], 4, 12 + 8, generator=g)
    w_uk, w_uv = torch.randn(4, 12, 24, generator=g) * 0.3, torch.randn(4, 6, 24, generator=g)
    q_ref = torch.cat([torch.einsum("nhd,hdr->nhr", q[..., :12], w_uk), q[..., 12:]], -1)
    ref = torch.einsum("nhr,hvr->nhv", naive_mla_absorbed_attention(q_ref, rows[read_rows], cu_q, cu_kv, 24, 0.2), w_uv)

    class NoFlatRows:
        @property
        def read_rows(self):
            raise AssertionError("the flat rows were planned")

    qd, ukd, uvd, rowsd, tabled, cu_qd, cu_kvd = (t.to(DEVICE) for t in (q, w_uk, w_uv, rows, table, cu_q, cu_kv))
    view = MlaRowsView(rowsd, cu_kvd, tabled, 4, NoFlatRows())
    close(OPS.mla_extend(qd, ukd, uvd, view, cu_qd, 24, 0.2), ref)
    assert OPS.mla_extend(qd, ukd, uvd, (rowsd, None, cu_kvd), cu_qd, 24, 0.2) is None  # no page table: gather


def test_decode_takes_flashinfer_where_it_fits(monkeypatch):
    """A paged view whose shapes FlashInfer takes goes to its adapter with the absorbed query (the
    adapter itself: test_flashinfer_mla.py); the same step without a page table stays on ours."""
    rows, table, read_rows, _, cu_kv, _ = _extend_case(11, [9, 4], [1, 1], heads=4)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 12 + 8, generator=g)
    w_uk, w_uv = torch.randn(4, 12, 24, generator=g) * 0.3, torch.randn(4, 6, 24, generator=g)
    calls = []

    def adapter(q_lat, view, rank, scale):
        calls.append(q_lat.shape)
        return mla_decode_attention(
            q_lat, view.rows, view.cu_kv, rank, scale, block_table=view.block_table, page_size=4
        )

    monkeypatch.setattr(flashinfer_mla, "fits", lambda q_lat, rows, rank, page: (rank, page) == (24, 4))
    monkeypatch.setattr(flashinfer_mla, "decode", adapter)
    qd, ukd, uvd, rowsd, tabled, cu_kvd, rrd = (t.to(DEVICE) for t in (q, w_uk, w_uv, rows, table, cu_kv, read_rows))
    paged = OPS.mla_decode(qd, ukd, uvd, MlaRowsView(rowsd, cu_kvd, tabled, 4, None), 24, 0.2)
    assert calls == [(2, 4, 24 + 8)]
    close(paged, OPS.mla_decode(qd, ukd, uvd, (rowsd, rrd, cu_kvd), 24, 0.2))
    assert len(calls) == 1


@cuda_only
def test_bf16_prefill_and_extend_on_cuda():
    """K3's geometry: 128 + 64 q/k, v 128, rank 512, pages of 16."""
    q, kv, latent, cu = _prefill_case(31, [1000, 77, 1], 8, 128, 64, 128, rank=512)
    ref = _prefill_ref(q.double(), kv.double(), latent.double(), cu, 128, 512, 192**-0.5)
    qd, kvd, latd = (t.to(DEVICE, torch.bfloat16) for t in (q, kv, latent))
    parts = (qd, kvd[..., :128], latd[:, 512:], kvd[..., 128:], cu.to(DEVICE), 192**-0.5)
    close(OPS.mla_prefill(*parts).float(), ref, rtol=2e-2)  # torch's flash kernel where this torch has it
    close(mla_prefill_attention(*parts).float(), ref, rtol=2e-2)  # ours
    rows, table, read_rows, cu_q, cu_kv, q_lat = _extend_case(32, [900, 0, 64], [300, 50, 1], 16, 512, 64, 16, 256)
    ref = naive_mla_absorbed_attention(q_lat.double(), rows[read_rows].double(), cu_q, cu_kv, 512, 0.05)
    args = [t.to(DEVICE, torch.bfloat16) for t in (q_lat, rows)]
    got = mla_extend_attention(*args, table.to(DEVICE), 16, cu_q.to(DEVICE), cu_kv.to(DEVICE), 512, 0.05)
    close(got.float(), ref, rtol=2e-2)
