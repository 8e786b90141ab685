"""MLA attention forms and MoE routing/execution vs float64 per-sequence / per-token loops."""

import torch

from deltaserve.ops.activations import silu_and_mul
from deltaserve.ops.mla import mla_absorbed_attention, mla_prefill_attention
from deltaserve.ops.moe import grouped_experts, route

G = torch.Generator().manual_seed(0)


def _causal(q, k, v, scale):
    t = q.shape[0]
    s = torch.einsum("thd,shd->hts", q, k) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)


def test_prefill_varlen_matches_per_sequence_loop():
    lens = [1, 7, 64, 30]
    cu = torch.tensor([0, *lens]).cumsum(0)
    q, k = torch.randn(2, sum(lens), 3, 24, generator=G, dtype=torch.float64)
    v = torch.randn(sum(lens), 3, 16, generator=G, dtype=torch.float64)
    got = mla_prefill_attention(q.float(), k.float(), v.float(), cu, 24**-0.5)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = _causal(q[lo:hi], k[lo:hi], v[lo:hi], 24**-0.5)
        torch.testing.assert_close(got[lo:hi].double(), ref, rtol=1e-5, atol=1e-5)


def test_absorbed_equals_plain_with_expanded_weights():
    h, r, dr, nope, dv = 2, 12, 4, 8, 6
    ctx_lens, q_lens = [5, 9, 1], [2, 9, 1]
    cu_kv, cu_q = torch.tensor([0, *ctx_lens]).cumsum(0), torch.tensor([0, *q_lens]).cumsum(0)
    rows = torch.randn(sum(ctx_lens), r + dr, generator=G, dtype=torch.float64)
    w_kvb = torch.randn(h, nope + dv, r, generator=G, dtype=torch.float64)
    q = torch.randn(sum(q_lens), h, nope + dr, generator=G, dtype=torch.float64)
    scale = (nope + dr) ** -0.5
    q_lat = torch.cat([torch.einsum("nhd,hdr->nhr", q[..., :nope], w_kvb[:, :nope]), q[..., nope:]], -1)
    o_lat = mla_absorbed_attention(q_lat.float(), rows.float(), cu_q, cu_kv, r, scale)
    got = torch.einsum("nhr,hvr->nhv", o_lat.double(), w_kvb[:, nope:])
    for b in range(3):
        c = rows[cu_kv[b] : cu_kv[b + 1]]
        kv = torch.einsum("sr,hdr->shd", c[:, :r], w_kvb)
        k = torch.cat([kv[..., :nope], c[:, None, r:].expand(-1, h, dr)], -1)
        full_q = torch.zeros(len(c), h, nope + dr, dtype=torch.float64)
        full_q[len(c) - q_lens[b] :] = q[cu_q[b] : cu_q[b + 1]]
        ref = _causal(full_q, k, kv[..., nope:], scale)[len(c) - q_lens[b] :]
        torch.testing.assert_close(got[cu_q[b] : cu_q[b + 1]], ref, rtol=1e-5, atol=1e-5)


def test_route_unbiased_weights_renorm_scale_and_remote_code_flag():
    x, w = torch.randn(6, 16, generator=G), torch.randn(10, 16, generator=G)
    bias = torch.randn(10, generator=G)
    weights, ids = route(x, w, bias, 3, routed_scaling_factor=2.446)
    s = torch.sigmoid(x.double() @ w.double().t())
    ref_ids = (s + bias.double()).topk(3).indices
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    ref_w = s.gather(1, ids)
    torch.testing.assert_close(weights.double(), ref_w / ref_w.sum(-1, keepdim=True) * 2.446, rtol=1e-6, atol=1e-6)
    biased, _ = route(x, w, bias, 3, routed_scaling_factor=2.446, bias_in_weights=True)
    ref_b = (s + bias.double()).gather(1, ids)
    torch.testing.assert_close(biased.double(), ref_b / ref_b.sum(-1, keepdim=True) * 2.446, rtol=1e-5, atol=1e-5)
    assert (biased - weights).abs().max() > 1e-3
    _, gids = route(x, w, bias, 2, num_expert_group=5, topk_group=1)
    assert torch.equal(gids.sort(-1).values // 2, (gids.sort(-1).values // 2)[:, :1].expand(-1, 2))


def test_grouped_experts_match_per_token_loop_and_rounding_order():
    n, k, e, d, i = 9, 3, 5, 16, 8
    x = torch.randn(n, d, generator=G).bfloat16()
    w1, w3 = (torch.randn(e, i, d, generator=G).bfloat16() for _ in range(2))
    w2 = torch.randn(e, d, i, generator=G).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=G)[:k] for _ in range(n)])
    wts = torch.rand(n, k, generator=G)
    got = grouped_experts(x, ids, wts, w1, w3, w2, silu_and_mul)
    for t in range(n):
        acc = torch.zeros(d)
        for j in range(k):
            ex = ids[t, j]
            y = (w2[ex] @ silu_and_mul(w1[ex] @ x[t], w3[ex] @ x[t])).bfloat16()
            acc += wts[t, j] * y.float()
        torch.testing.assert_close(got[t].float(), acc.bfloat16().float(), rtol=1e-2, atol=1e-2)
