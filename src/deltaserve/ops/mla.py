"""Multi-head Latent Attention ops, NoPE (spec/model.md §7).

The latent cache row of a token is `[c_hat (kv_lora_rank) | k_rot (qk_rope_head_dim)]`,
c_hat already normalised. Nothing here is rotated: there are no positions in the text model.

The ops pad the packed sequences into batches and call torch's scaled_dot_product_attention,
whose CPU flash kernel is blockwise (no [T, T] score matrix) and runs the softmax in fp32 for
bf16 inputs (measured: bf16 output error equals that of an fp32 upcast, i.e. the output
rounding). The flash kernel needs equal q/k/v head dims, so v is zero-padded where narrower.
Sequences are grouped into length buckets (`length_buckets`) so that padding wastes at most
about 2x the real attention work. Over a cached context, `mla_context_attention` runs the
unabsorbed form on decompressed rows and `mla_absorbed_attention` the absorbed one;
`unabsorbed_sequences` picks by multiply-adds (vLLM's MLA prefill likewise decompresses the cached
context, where decode stays absorbed).

Decode context parallelism splits a context's rows across ranks: `mla_absorbed_partial` attends
over one rank's share (masked by global position) and returns its log-sum-exp, and
`lse_combine` merges the shares into the attention over the whole context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.transfer import host_copy

_BUCKET_SLACK = 1 << 16  # padded work (query x key pairs) always tolerated per bucket
_FOLD_LIMIT = 1 << 27  # max mask elements for the head-folded (MQA) absorbed path
_SCORE_LIMIT = 1 << 24  # max fp32 score elements per block of the partial (explicit-softmax) path
UNABSORBED_BYTES = 1 << 30  # most bytes a step's decompressed context keys and values may hold (bf16)


def length_buckets(ns: list[int], cs: list[int], waste: float = 2.0, slack: int = _BUCKET_SLACK) -> list[list[int]]:
    """Group sequences (n_b queries over c_b keys each) into buckets padded to one batch.
    A bucket's padded work `len * max(n) * max(c)` stays within `waste * sum(n_b * c_b) + slack`.
    Sequences with no query are dropped. Returns lists of sequence indices."""
    order = sorted((b for b in range(len(ns)) if ns[b] > 0), key=lambda b: (ns[b] * cs[b], ns[b]), reverse=True)
    buckets: list[list[int]] = []
    cur: list[int] = []
    max_n = max_c = work = 0
    for b in order:
        n, c = ns[b], cs[b]
        mn, mc = max(max_n, n), max(max_c, c)
        if cur and (len(cur) + 1) * mn * mc > waste * (work + n * c) + slack:
            buckets.append(cur)
            cur, mn, mc, work = [], n, c, 0
        cur.append(b)
        max_n, max_c, work = mn, mc, work + n * c
    if cur:
        buckets.append(cur)
    return buckets


def _pad_index(starts: list[int], lens: torch.Tensor, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src rows in the packed tensor, dst rows in the [len(lens) * width] padded tensor), planned
    on the host from host `starts` and `lens`, sent to `device` without waiting for it."""
    seg = torch.repeat_interleave(torch.arange(len(lens)), lens)
    first = torch.cumsum(lens, 0) - lens
    t = torch.arange(int(lens.sum())) - first[seg]
    src, dst = torch.tensor(starts, dtype=torch.long)[seg] + t, seg * width + t
    return src.to(device, non_blocking=True), dst.to(device, non_blocking=True)


def _padded(x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, rows: int) -> torch.Tensor:
    out = x.new_zeros((rows,) + tuple(x.shape[1:]))
    out[dst] = x[src]
    return out


def _lens(cu: torch.Tensor) -> tuple[list[int], list[int]]:
    """(starts, lengths) of the packed sequences, read from `cu`'s host copy."""
    cu = [int(v) for v in host_copy(cu).tolist()]
    return cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]


def joined_keys(k_nope: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """The unabsorbed keys [N, H, Dn + Dr]: each head's k_nope [N, H, Dn] beside the rope part
    k_rot [N, Dr] all heads share."""
    n, h = k_nope.shape[:2]
    return torch.cat([k_nope, k_rot[:, None].expand(n, h, k_rot.shape[-1])], dim=-1)


def _equal_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v in q's dtype, zero-padded to one head dim (SDPA's flash kernel needs equal dims;
    the zero columns add nothing to the scores, and the output's are dropped)."""
    d = max(q.shape[-1], v.shape[-1])
    k, v = k.to(q.dtype), v.to(q.dtype)
    if q.shape[-1] < d:
        q, k = F.pad(q, (0, d - q.shape[-1])), F.pad(k, (0, d - k.shape[-1]))
    if v.shape[-1] < d:
        v = F.pad(v, (0, d - v.shape[-1]))
    return q, k, v


def mla_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention within each packed sequence (unabsorbed form).
    q, k: [N, H, Dqk]; v: [N, H, Dv]; returns [N, H, Dv] in q's dtype (softmax in fp32)."""
    return _unabsorbed_attention(q, k, v, cu_seqlens, cu_seqlens, scale, square=True)


def _context_buckets(cu_q: torch.Tensor, cu_kv: torch.Tensor, dev, masks: bool = True):
    """Per length bucket of the sequences (n_b new queries over c_b context rows each, the queries
    the last n_b positions): (q_src, q_dst, k_src, k_dst) as `_pad_index` gives them, nb, mq, mc (the
    bucket's sequences, most queries, most rows), `allowed` [nb, mq, mc], query i of sequence b
    seeing rows [0, c_b - n_b + i] (padded queries see padded zero rows: finite, dropped by q_dst;
    None without `masks`), and the first query and context row of a bucket of one sequence (else None)."""
    q_starts, ns = _lens(cu_q)
    kv_starts, cs = _lens(cu_kv)
    if len(ns) != len(cs) or any(n > c for n, c in zip(ns, cs)):
        raise ValueError("every sequence needs at least as many context rows as queries")
    for bucket in length_buckets(ns, cs):
        b_n = torch.tensor([ns[b] for b in bucket])
        b_c = torch.tensor([cs[b] for b in bucket])
        nb, mq, mc = len(bucket), int(b_n.max()), int(b_c.max())
        q_src, q_dst = _pad_index([q_starts[b] for b in bucket], b_n, mq, dev)
        k_src, k_dst = _pad_index([kv_starts[b] for b in bucket], b_c, mc, dev)
        allowed = None
        if masks:
            last = (b_c - b_n).to(dev, non_blocking=True).view(nb, 1, 1) + torch.arange(mq, device=dev).view(1, mq, 1)
            allowed = torch.arange(mc, device=dev).view(1, 1, mc) <= last
        alone = (q_starts[bucket[0]], kv_starts[bucket[0]]) if nb == 1 else None
        yield q_src, q_dst, k_src, k_dst, nb, mq, mc, allowed, alone


def mla_absorbed_attention(
    q_latent: torch.Tensor,
    kv_latent: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed (MQA over the latent) attention of new queries over each sequence's context.
    q_latent: [Nq, H, R + Dr] = [W_UK^T q_nope | q_rot] per head; kv_latent: [Nkv, R + Dr]
    latent rows of every sequence's full context (cached + new), packed by cu_kv.
    Query i of sequence b (of n_b queries, c_b context rows) sits at position c_b - n_b + i and
    sees context rows [0, c_b - n_b + i]. Keys are the full rows, values the first R columns.
    Returns the latent outputs [Nq, H, R] in q_latent's dtype (softmax in fp32).

    The full rows serve as values too (equal head dims keep SDPA on its flash kernel); the
    output's last Dr columns are dropped. Few queries (decode): heads are folded into the query
    axis against one shared KV head; many queries: SDPA's native GQA broadcast."""
    nq, h, dk = q_latent.shape
    kv = kv_latent.to(q_latent.dtype)
    out = q_latent.new_empty(nq, h, kv_lora_rank)
    for q_src, q_dst, k_src, k_dst, nb, mq, mc, allowed, _ in _context_buckets(cu_q, cu_kv, q_latent.device):
        qp = _padded(q_latent, q_src, q_dst, nb * mq).view(nb, mq, h, dk)
        kp = _padded(kv, k_src, k_dst, nb * mc).view(nb, 1, mc, dk)
        if nb * mq * h * mc <= _FOLD_LIMIT:
            mask = allowed[:, None, :, None, :].expand(nb, 1, mq, h, mc).reshape(nb, 1, mq * h, mc)
            o = F.scaled_dot_product_attention(qp.view(nb, 1, mq * h, dk), kp, kp, attn_mask=mask, scale=scale)
            o = o.view(nb * mq, h, dk)
        else:
            o = F.scaled_dot_product_attention(
                qp.transpose(1, 2), kp, kp, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
            )
            o = o.transpose(1, 2).reshape(nb * mq, h, dk)
        out[q_src] = o[q_dst, :, :kv_lora_rank]
    return out


def mla_context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_kv: torch.Tensor, scale: float
) -> torch.Tensor:
    """Unabsorbed attention of new queries over each sequence's whole context (cached + new): q
    [Nq, H, Dqk] packed by cu_q, k [Nkv, H, Dqk] and v [Nkv, H, Dv] (the context rows decompressed)
    packed by cu_kv; positions as `mla_absorbed_attention`. Returns [Nq, H, Dv] in q's dtype
    (softmax in fp32); v is zero-padded to Dqk where narrower (SDPA's flash kernel)."""
    return _unabsorbed_attention(q, k, v, cu_q, cu_kv, scale, square=False)


def _unabsorbed_attention(q, k, v, cu_q, cu_kv, scale: float, square: bool) -> torch.Tensor:
    """Both unabsorbed ops: `square` (every sequence queries all its rows) takes SDPA's causal flag
    (top-left and bottom-right alignment agree; left-aligned padding stays hidden from real
    queries), else the buckets' masks. A bucket of one sequence attends over views (no padded copies)."""
    nq, h, _ = q.shape
    dv = v.shape[-1]
    q, k, v = _equal_head_dims(q, k, v)
    d = q.shape[-1]
    out = q.new_empty(nq, h, dv)
    for q_src, q_dst, k_src, k_dst, nb, mq, mc, allowed, alone in _context_buckets(cu_q, cu_kv, q.device, not square):
        mask = dict(is_causal=True) if square else dict(attn_mask=allowed[:, None])
        if alone is not None:
            qs, ks = alone
            qp = q[qs : qs + mq].unsqueeze(0).transpose(1, 2)
            kp, vp = (t[ks : ks + mc].unsqueeze(0).transpose(1, 2) for t in (k, v))
            o = F.scaled_dot_product_attention(qp, kp, vp, scale=scale, **mask)
            out[qs : qs + mq] = o[0].transpose(0, 1)[..., :dv]
            continue
        qp = _padded(q, q_src, q_dst, nb * mq).view(nb, mq, h, d).transpose(1, 2)
        kp, vp = (_padded(t, k_src, k_dst, nb * mc).view(nb, mc, h, d).transpose(1, 2) for t in (k, v))
        o = F.scaled_dot_product_attention(qp, kp, vp, scale=scale, **mask)
        out[q_src] = o.transpose(1, 2).reshape(nb * mq, h, d)[q_dst, :, :dv]
    return out


def unabsorbed_row_bytes(heads: int, rope: int, nope: int, v: int) -> int:
    """Bytes a decompressed context row holds on the SDPA path (`mla_context_attention`): its keys and
    values as decompressed, its joined keys and its padded values, H x 2 x (nope + v + 2 max(nope +
    rope, v)) (bf16; 10 KiB at 8 of K3's heads)."""
    return heads * 2 * (nope + v + 2 * max(nope + rope, v))


def unabsorbed_sequences(
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    heads: int,
    rank: int,
    rope: int,
    nope: int,
    v: int,
    row_bytes: int | None = None,
) -> list[int]:
    """The sequences whose attention over their cached context costs fewer multiply-adds unabsorbed
    (each context row's keys and values decompressed, rank x H x (nope + v), then H x 2 x max(nope +
    rope, v) a visible pair) than absorbed (H x 2 x (rank + rope) a pair): those with more than
    rank (nope + v) / (2 (rank + rope - max(nope + rope, v))) queries, ~170 at K3's sizes (prefill
    chunks; decode never), in order while what they hold at once fits `UNABSORBED_BYTES`, `row_bytes`
    a context row (the backend's `unabsorbed_row_bytes`; default the SDPA path's)."""
    _, ns = _lens(cu_q)
    _, cs = _lens(cu_kv)
    saved = 2 * (rank + rope - max(nope + rope, v))
    row_bytes = unabsorbed_row_bytes(heads, rope, nope, v) if row_bytes is None else row_bytes
    chosen, held = [], 0
    for b, (n, c) in enumerate(zip(ns, cs)):
        if n * saved > rank * (nope + v) and held + c * row_bytes <= UNABSORBED_BYTES:
            chosen.append(b)
            held += c * row_bytes
    return chosen


def _rows_of(cu: torch.Tensor, seqs: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(the packed rows of sequences `seqs`, every sequence's row count with the others' zeroed)."""
    starts, lens = _lens(cu)
    rows = torch.cat([torch.arange(starts[b], starts[b] + lens[b]) for b in seqs])
    kept = set(seqs)
    return rows, [n if b in kept else 0 for b, n in enumerate(lens)]


def _cumulative(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens]).cumsum(0)


def sequence_subset(cu_q: torch.Tensor, cu_kv: torch.Tensor, seqs: list[int]):
    """(query rows, context rows, cu_q, cu_kv) of sequences `seqs` (ascending) of a packed batch, as
    host int64 tensors: the sub-batch of those sequences alone."""
    (q_rows, ns), (kv_rows, cs) = _rows_of(cu_q, seqs), _rows_of(cu_kv, seqs)
    return q_rows, kv_rows, _cumulative([ns[b] for b in seqs]), _cumulative([cs[b] for b in seqs])


def queries_of(cu_q: torch.Tensor, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(query rows of sequences `seqs`, cu_q where every other sequence has no query): their
    attention over the whole batch's contexts as they are (the others' rows skipped, not copied)."""
    q_rows, ns = _rows_of(cu_q, seqs)
    return q_rows, _cumulative(ns)


def mla_absorbed_partial(
    q_latent: torch.Tensor,
    kv_latent: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of new queries over a share of each sequence's latent rows (one DCP
    rank's), masked causally by global position: query i of sequence b sees the rows of sequence
    b (packed by cu_kv) with kv_pos <= q_pos[i]. Shapes as `mla_absorbed_attention`; q_pos [Nq] and
    kv_pos [Nkv] are int64. Returns (o [Nq, H, R], the softmax over the visible rows only, and
    lse [Nq, H], the log-sum-exp of their scaled scores), both fp32; a query that sees no row gets
    o = 0 and lse = -inf. `lse_combine` of every share is the attention over their union."""
    nq, h, dk = q_latent.shape
    q_starts, ns = _lens(cu_q)
    kv_starts, cs = _lens(cu_kv)
    if len(ns) != len(cs):
        raise ValueError("cu_q and cu_kv must describe the same sequences")
    q, kv = q_latent.float(), kv_latent.float()
    out = q.new_zeros(nq, h, kv_lora_rank)
    lse_out = q.new_full((nq, h), float("-inf"))
    for bucket in length_buckets(ns, cs):
        b_n = torch.tensor([ns[b] for b in bucket])
        b_c = torch.tensor([cs[b] for b in bucket])
        nb, mq, mc = len(bucket), int(b_n.max()), max(int(b_c.max()), 1)
        q_src, q_dst = _pad_index([q_starts[b] for b in bucket], b_n, mq, q.device)
        k_src, k_dst = _pad_index([kv_starts[b] for b in bucket], b_c, mc, q.device)
        qp = _padded(q, q_src, q_dst, nb * mq).view(nb, mq, h, dk)
        kp = _padded(kv, k_src, k_dst, nb * mc).view(nb, mc, dk)
        # padded queries see nothing (position -1); padded keys are never seen (position max)
        qpos = torch.full((nb * mq,), -1, dtype=torch.long, device=q.device)
        qpos[q_dst] = q_pos[q_src]
        kpos = torch.full((nb * mc,), torch.iinfo(torch.long).max, dtype=torch.long, device=q.device)
        kpos[k_dst] = kv_pos[k_src]
        qpos, kpos = qpos.view(nb, mq), kpos.view(nb, 1, mc)
        o = q.new_empty(nb, mq, h, kv_lora_rank)
        lse = q.new_empty(nb, mq, h)
        step = max(1, _SCORE_LIMIT // (nb * h * mc))
        for lo in range(0, mq, step):
            hi = min(mq, lo + step)
            s = torch.einsum("bqhd,bkd->bqhk", qp[:, lo:hi], kp) * scale
            s.masked_fill_((kpos > qpos[:, lo:hi, None])[:, :, None], float("-inf"))
            m = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)[..., None])
            o[:, lo:hi] = torch.einsum("bqhk,bkr->bqhr", p, kp[..., :kv_lora_rank])
            lse[:, lo:hi] = m
        out[q_src] = o.view(nb * mq, h, kv_lora_rank)[q_dst]
        lse_out[q_src] = lse.view(nb * mq, h)[q_dst]
    return out, lse_out


def lse_combine(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial attentions over disjoint key sets: o [P, N, H, R] (each normalised over its
    own keys), lse [P, N, H] (-inf where a part saw no key) -> (o [N, H, R], lse [N, H]) of the
    attention over all their keys, in fp32 (o = 0, lse = -inf where no part saw a key)."""
    o, lse = o.float(), lse.float()
    top = lse.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    w = torch.exp(lse - top)  # [P, N, H]; 0 for empty parts
    total = w.sum(dim=0)
    merged = (w[..., None] * o).sum(dim=0) / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return merged, top + torch.log(total)
