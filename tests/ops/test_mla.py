"""MLA attention ops vs oracles; absorbed vs plain form (spec/model.md §7).

Tolerances: fp32 op vs float64 oracle within 1e-5 relative + 1e-5 * max|ref| absolute
(SDPA's blockwise fp32 softmax); float64 oracles against each other within 1e-10.
"""

import pytest
import torch

import deltaserve.ops.mla as mla
from deltaserve.ops.mla import (
    length_buckets,
    mla_absorbed_attention,
    mla_context_attention,
    mla_prefill_attention,
    unabsorbed_sequences,
)
from deltaserve.ops.reference.dense import (
    naive_mla_absorbed_attention,
    naive_mla_layer_absorbed,
    naive_mla_layer_plain,
    naive_mla_prefill_attention,
    naive_rms_norm,
)

NOPE, ROPE, DV, R, H = 128, 64, 128, 512, 4
SCALE = (NOPE + ROPE) ** -0.5
TOL = 1e-5


def _close(out, ref, tol=TOL):
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol * float(ref.abs().max()))


def _cu(lens):
    return torch.tensor([0] + lens).cumsum(0)


def _qkv(n, dtype=torch.float32):
    return (
        torch.randn(n, H, NOPE + ROPE, dtype=dtype),
        torch.randn(n, H, NOPE + ROPE, dtype=dtype),
        torch.randn(n, H, DV, dtype=dtype),
    )


@pytest.mark.parametrize("lens", [[1, 7, 64, 100], [200, 3, 1, 5], [33]])
def test_prefill_varlen_vs_oracle(lens):
    torch.manual_seed(len(lens))
    q, k, v = _qkv(sum(lens))
    out = mla_prefill_attention(q, k, v, _cu(lens), SCALE)
    assert out.shape == v.shape and out.dtype == torch.float32
    _close(out, naive_mla_prefill_attention(q.double(), k.double(), v.double(), _cu(lens), SCALE))


@pytest.mark.parametrize("lens", [[1, 7, 64], [50]])  # padded and single-sequence paths
def test_prefill_scale_is_passed_and_bf16(lens):
    """A non-default scale (SDPA's default 192^-1/2 equals the spec's, so it must be passed)."""
    torch.manual_seed(1)
    q, k, v = _qkv(sum(lens))
    ref = naive_mla_prefill_attention(q.double(), k.double(), v.double(), _cu(lens), 0.3)
    _close(mla_prefill_attention(q, k, v, _cu(lens), 0.3), ref)
    b = mla_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), _cu(lens), SCALE)
    assert b.dtype == torch.bfloat16
    ref = naive_mla_prefill_attention(*(t.bfloat16().double() for t in (q, k, v)), _cu(lens), SCALE)
    torch.testing.assert_close(b.double(), ref, rtol=2**-7, atol=2e-2)


def test_length_buckets_cover_every_sequence():
    ns = [1, 7, 64, 100, 600, 2, 2, 0, 3000]
    buckets = length_buckets(ns, ns)
    flat = sorted(b for bucket in buckets for b in bucket)
    assert flat == [b for b in range(len(ns)) if ns[b] > 0]
    assert len(buckets) > 1
    for bucket in buckets:
        padded = len(bucket) * max(ns[b] for b in bucket) ** 2
        assert padded <= 2 * sum(ns[b] ** 2 for b in bucket) + mla._BUCKET_SLACK


def _latent_case(ctx, new, seed=0):
    """Random latent rows, queries and kv_b for sequences with ctx rows, the last `new` queried."""
    torch.manual_seed(seed)
    n = sum(ctx)
    c_hat = naive_rms_norm(torch.randn(n, R), torch.rand(R) + 0.5, 1e-6)
    k_rot = torch.randn(n, ROPE)
    q = torch.randn(n, H, NOPE + ROPE)
    w_kvb = torch.randn(H * (NOPE + DV), R) * R**-0.5
    starts = [0] + torch.tensor(ctx).cumsum(0).tolist()[:-1]
    rows = torch.cat([torch.arange(s + c - m, s + c) for s, c, m in zip(starts, ctx, new)])
    return c_hat, k_rot, q, w_kvb, rows


def _plain(c_hat, k_rot, q, w_kvb, cu):
    n = c_hat.shape[0]
    kv = (c_hat @ w_kvb.T).view(n, H, NOPE + DV)
    k = torch.cat([kv[..., :NOPE], k_rot[:, None].expand(n, H, ROPE)], dim=-1)
    return mla_prefill_attention(q, k, kv[..., NOPE:].contiguous(), cu, SCALE)


def _absorbed(c_hat, k_rot, q, w_kvb, rows, cu_q, cu_kv):
    w = w_kvb.view(H, NOPE + DV, R)
    q_lat = torch.cat([torch.einsum("nhd,hdr->nhr", q[rows, :, :NOPE], w[:, :NOPE]), q[rows, :, NOPE:]], dim=-1)
    kv_rows = torch.cat([c_hat, k_rot], dim=-1)
    o_lat = mla_absorbed_attention(q_lat, kv_rows, cu_q, cu_kv, R, SCALE)
    return torch.einsum("nhr,hvr->nhv", o_lat, w[:, NOPE:]), q_lat, kv_rows


@pytest.mark.parametrize("fold_limit", [1 << 27, 0])  # head-folded and GQA-broadcast paths
def test_absorbed_matches_prefill_with_context(fold_limit, monkeypatch):
    """Several queries per sequence over a cached context, including single-query decode and a
    whole-sequence prefill; the fast absorbed form must equal the fast plain form's rows."""
    monkeypatch.setattr(mla, "_FOLD_LIMIT", fold_limit)
    ctx, new = [5, 64, 100, 1, 30, 7], [1, 7, 3, 1, 30, 1]
    c_hat, k_rot, q, w_kvb, rows = _latent_case(ctx, new)
    plain = _plain(c_hat, k_rot, q, w_kvb, _cu(ctx))[rows]
    absorbed, q_lat, kv_rows = _absorbed(c_hat, k_rot, q, w_kvb, rows, _cu(new), _cu(ctx))
    _close(absorbed, plain)
    ref = naive_mla_absorbed_attention(q_lat.double(), kv_rows.double(), _cu(new), _cu(ctx), R, SCALE)
    _close(mla_absorbed_attention(q_lat, kv_rows, _cu(new), _cu(ctx), R, SCALE), ref)


def test_absorbed_decode_batch_and_bf16():
    ctx, new = [40, 1, 17, 90], [1, 1, 1, 1]
    c_hat, k_rot, q, w_kvb, rows = _latent_case(ctx, new, seed=3)
    absorbed, q_lat, kv_rows = _absorbed(c_hat, k_rot, q, w_kvb, rows, _cu(new), _cu(ctx))
    _close(absorbed, _plain(c_hat, k_rot, q, w_kvb, _cu(ctx))[rows])
    b = mla_absorbed_attention(q_lat.bfloat16(), kv_rows.bfloat16(), _cu(new), _cu(ctx), R, SCALE)
    assert b.dtype == torch.bfloat16 and b.shape == (4, H, R)
    ref = naive_mla_absorbed_attention(
        q_lat.bfloat16().double(), kv_rows.bfloat16().double(), _cu(new), _cu(ctx), R, SCALE
    )
    torch.testing.assert_close(b.double(), ref, rtol=2**-7, atol=2e-2 * float(ref.abs().max()))


def test_context_form_matches_plain_prefill_rows():
    """The unabsorbed form over decompressed context rows (prefill chunks over a cached prefix,
    decode among them) equals the plain form's rows of the whole sequences, and the float64 oracle."""
    ctx, new = [5, 64, 100, 1, 30, 7], [2, 7, 60, 1, 30, 1]
    c_hat, k_rot, q, w_kvb, rows = _latent_case(ctx, new, seed=4)
    n = c_hat.shape[0]
    kv = (c_hat @ w_kvb.T).view(n, H, NOPE + DV)
    k = torch.cat([kv[..., :NOPE], k_rot[:, None].expand(n, H, ROPE)], dim=-1)
    v = kv[..., NOPE:].contiguous()
    got = mla_context_attention(q[rows], k, v, _cu(new), _cu(ctx), SCALE)  # one padded bucket
    _close(got, _plain(c_hat, k_rot, q, w_kvb, _cu(ctx))[rows])
    alone = mla_context_attention(q[rows][9:69], k[69:169], v[69:169], _cu([60]), _cu([100]), SCALE)  # views
    _close(alone, got[9:69])
    ref = naive_mla_prefill_attention(q.double(), k.double(), v.double(), _cu(ctx), SCALE)[rows]
    _close(got, ref)
    b = mla_context_attention(q[rows].bfloat16(), k.bfloat16(), v.bfloat16(), _cu(new), _cu(ctx), SCALE)
    assert b.dtype == torch.bfloat16 and b.shape == (len(rows), H, DV)
    torch.testing.assert_close(b.double(), ref, rtol=2**-7, atol=2e-2 * float(ref.abs().max()))
    with pytest.raises(ValueError):
        mla_context_attention(q[:3], k[:2], v[:2], _cu([3]), _cu([2]), SCALE)


def test_unabsorbed_for_prefill_chunks_not_decode(monkeypatch):
    """K3's sizes (rank 512, rope 64, nope 128, v 128): the break-even is ~170 queries a sequence,
    whatever its context; the sequences chosen must fit the bytes their keys and values take."""
    sizes = dict(heads=64, rank=512, rope=64, nope=128, v=128)
    assert unabsorbed_sequences(_cu([2048]), _cu([8192]), **sizes) == [0]
    assert unabsorbed_sequences(_cu([1, 512, 1, 171, 170]), _cu([9000, 4096, 5, 300, 300]), **sizes) == [1, 3]
    assert unabsorbed_sequences(_cu([1] * 8), _cu([4096] * 8), **sizes) == []  # decode
    monkeypatch.setattr(mla, "UNABSORBED_BYTES", 8192 * 64 * 2 * (256 + 2 * 192) - 1)
    assert unabsorbed_sequences(_cu([2048, 300]), _cu([8192, 400]), **sizes) == [1]
    # a backend whose rows hold less (the native flash kernel: the kv_b output alone) fits both
    assert unabsorbed_sequences(_cu([2048, 300]), _cu([8192, 400]), **sizes, row_bytes=64 * 2 * 256) == [0, 1]


def test_sub_batches_of_sequences():
    """A mixed step's split: the chosen sequences as a batch of their own, the others' queries over
    the whole batch's contexts (sequences without queries are skipped by the attention ops)."""
    cu_q, cu_kv = _cu([2, 1, 3]), _cu([5, 4, 6])
    q_rows, kv_rows, sub_q, sub_kv = mla.sequence_subset(cu_q, cu_kv, [0, 2])
    assert q_rows.tolist() == [0, 1, 3, 4, 5] and kv_rows.tolist() == [0, 1, 2, 3, 4, 9, 10, 11, 12, 13, 14]
    assert sub_q.tolist() == [0, 2, 5] and sub_kv.tolist() == [0, 5, 11]
    rows, only = mla.queries_of(cu_q, [1])
    assert rows.tolist() == [2] and only.tolist() == [0, 0, 1, 1]
    ctx, new = [5, 4, 6], [2, 1, 3]
    c_hat, k_rot, q, w_kvb, all_rows = _latent_case(ctx, new, seed=6)
    _, q_lat, kv_rows = _absorbed(c_hat, k_rot, q, w_kvb, all_rows, _cu(new), _cu(ctx))
    part = mla_absorbed_attention(q_lat[rows], kv_rows, only, _cu(ctx), R, SCALE)
    _close(part, mla_absorbed_attention(q_lat, kv_rows, _cu(new), _cu(ctx), R, SCALE)[rows])


def test_absorbed_rejects_more_queries_than_context():
    with pytest.raises(ValueError):
        mla_absorbed_attention(torch.randn(3, H, R + ROPE), torch.randn(2, R + ROPE), _cu([3]), _cu([2]), R, SCALE)


def _layer_weights(d, q_lora, gate, seed):
    torch.manual_seed(seed)

    def g(*s):
        return torch.randn(*s, dtype=torch.float64) * s[-1] ** -0.5

    w = dict(
        kv_a=g(R + ROPE, d),
        kv_a_norm=torch.rand(R, dtype=torch.float64) + 0.5,
        kv_b=g(H * (NOPE + DV), R),
        o_proj=g(d, H * DV),
        num_heads=H,
    )
    if q_lora:
        w.update(
            q_a=g(q_lora, d), q_a_norm=torch.rand(q_lora, dtype=torch.float64) + 0.5, q_b=g(H * (NOPE + ROPE), q_lora)
        )
    else:
        w.update(q_proj=g(H * (NOPE + ROPE), d))
    if gate:
        w.update(g_proj=g(H * DV, d))
    return w


@pytest.mark.parametrize("q_lora,gate", [(96, True), (None, False)])  # K3-like, Kimi-Linear
def test_layer_oracles_plain_equals_absorbed(q_lora, gate):
    w = _layer_weights(64, q_lora, gate, seed=5)
    x = torch.randn(12, 64, dtype=torch.float64)
    plain = naive_mla_layer_plain(x, **w)
    assert plain.shape == x.shape
    torch.testing.assert_close(naive_mla_layer_absorbed(x, **w), plain, rtol=1e-10, atol=1e-10)


def test_fast_ops_compose_to_layer_oracle():
    """The model-layer recipe (latent rows, plain prefill, gate, o_proj) from fast ops in fp32
    equals the float64 layer oracle, per sequence of a packed batch."""
    w = _layer_weights(64, 96, True, seed=6)
    lens = [1, 7, 20]
    x = torch.randn(sum(lens), 64, dtype=torch.float64)
    f = {k: v.float() for k, v in w.items() if torch.is_tensor(v)}
    from deltaserve.ops.norms import rms_norm

    xf = x.float()
    q = (rms_norm(xf @ f["q_a"].T, f["q_a_norm"], 1e-6) @ f["q_b"].T).view(-1, H, NOPE + ROPE)
    kv = xf @ f["kv_a"].T
    c_hat, k_rot = rms_norm(kv[:, :R], f["kv_a_norm"], 1e-6), kv[:, R:]
    o = _plain(c_hat, k_rot, q, f["kv_b"], _cu(lens)).reshape(len(x), H * DV)
    out = (o * torch.sigmoid(xf @ f["g_proj"].T)) @ f["o_proj"].T
    starts = [0, 1, 8, 28]
    ref = torch.cat([naive_mla_layer_plain(x[a:b], **w) for a, b in zip(starts[:-1], starts[1:])])
    _close(out, ref)
