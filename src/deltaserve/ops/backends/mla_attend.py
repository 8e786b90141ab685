"""The attention of an MLA layer's step as one backend call (`TorchOps.mla_attend`), composed from
the backend's own ops, so a backend overrides the pieces and every caller gets an answer:
- no cache: causal unabsorbed attention within each packed sequence (`mla_prefill`);
- the pool readable in place: `mla_decode` (one query per sequence) or `mla_extend` (several),
  where the backend has a kernel for them (they answer None where it does not fit);
- otherwise the context the cache gathers (`mla_context`), attended in the unabsorbed form (its
  rows' keys and values decompressed) for the sequences where that costs fewer multiply-adds
  (`mla.unabsorbed_sequences`: prefill chunks) and in the absorbed form for the rest (decode); a
  step with both runs each on its own sequences.
Shapes: q [N, H, nope + rope], latent rows [N, R + rope], w_kv = kv_b_proj's weight [H * (nope + v), R].
"""

from __future__ import annotations

import torch

from .. import mla as mla_fns


def attend(ops, q, latent, w_kv, cache, layer_id: int, cu_seqlens, rank: int, scale: float, prepared=None):
    """o [N, H, v] of the step's queries (the new rows already stored in `cache`, if any)."""
    heads, rope = q.shape[1], latent.shape[-1] - rank
    w = w_kv.view(heads, -1, rank)
    nope = q.shape[-1] - rope
    if cache is None:
        return _plain(ops, q, latent, w_kv, cu_seqlens, rank, scale)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    view = getattr(cache, "mla_rows_view", None)
    view = None if view is None else view(layer_id)
    o = None
    if view is not None and cache.decode_only:
        o = ops.mla_decode(q, w_uk, w_uv, view, rank, scale, prepared)
    elif view is not None:
        o = ops.mla_extend(q, w_uk, w_uv, view, cu_seqlens, rank, scale)
    if o is not None:
        return o
    context = cache.mla_context(layer_id)
    if context is None:
        return _plain(ops, q, latent, w_kv, cu_seqlens, rank, scale)
    return _cached(ops, q, *context, cu_seqlens, w_kv, rank, scale)


def _keys_values(ops, c_hat: torch.Tensor, w_kv: torch.Tensor, heads: int, nope: int):
    """(k_nope [N, H, nope], v [N, H, v]) of latent rows' c_hat [N, rank]."""
    kv = ops.linear(c_hat, w_kv).view(c_hat.shape[0], heads, -1)
    return kv[..., :nope], kv[..., nope:]


def _plain(ops, q, latent, w_kv, cu_seqlens, rank, scale):
    nope = q.shape[-1] - (latent.shape[-1] - rank)
    k_nope, v = _keys_values(ops, latent[:, :rank], w_kv, q.shape[1], nope)
    return ops.mla_prefill(q, k_nope, latent[:, rank:], v, cu_seqlens, scale)


def _cached(ops, q, rows, cu_kv, cu_q, w_kv, rank, scale):
    """Attention over cached contexts, each sequence in the form that costs it less."""
    h, rope = q.shape[1], rows.shape[-1] - rank
    nope = q.shape[-1] - rope
    v_dim = w_kv.shape[0] // h - nope
    row_bytes = ops.unabsorbed_row_bytes(h, rope, nope, v_dim)
    wide = mla_fns.unabsorbed_sequences(cu_q, cu_kv, h, rank, rope, nope, v_dim, row_bytes)
    num_seqs = cu_q.numel() - 1
    if len(wide) in (0, num_seqs):
        return (_unabsorbed if wide else _absorbed)(ops, q, rows, cu_kv, cu_q, w_kv, rank, scale)
    out = q.new_empty(q.shape[0], h, v_dim)
    q_rows, kv_rows, sub_q, sub_kv = (t.to(q.device) for t in mla_fns.sequence_subset(cu_q, cu_kv, wide))
    out[q_rows] = _unabsorbed(ops, q[q_rows], rows[kv_rows], sub_kv, sub_q, w_kv, rank, scale)
    narrow = sorted(set(range(num_seqs)) - set(wide))
    q_rows, narrow_q = (t.to(q.device) for t in mla_fns.queries_of(cu_q, narrow))
    out[q_rows] = _absorbed(ops, q[q_rows], rows, cu_kv, narrow_q, w_kv, rank, scale)  # others' rows skipped
    return out


def _unabsorbed(ops, q, rows, cu_kv, cu_q, w_kv, rank, scale):
    nope = q.shape[-1] - (rows.shape[-1] - rank)
    k_nope, v = _keys_values(ops, rows[:, :rank], w_kv, q.shape[1], nope)
    return ops.mla_context_prefill(q, k_nope, rows[:, rank:], v, cu_q, cu_kv, scale)


def _absorbed(ops, q, rows, cu_kv, cu_q, w_kv, rank, scale):
    h = q.shape[1]
    nope = q.shape[-1] - (rows.shape[-1] - rank)
    w = w_kv.view(h, -1, rank)
    q_hat = torch.einsum("nhd,hdr->nhr", q[..., :nope], w[:, :nope])
    o_lat = ops.mla_absorbed(torch.cat([q_hat, q[..., nope:]], dim=-1), rows, cu_q, cu_kv, rank, scale)
    return torch.einsum("nhr,hvr->nhv", o_lat, w[:, nope:])
