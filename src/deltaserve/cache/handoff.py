"""The cache side of prefill/decode disaggregation: which bytes of the pools a handoff moves.

A handoff moves one request's state at one exact token boundary `n` (the prompt minus its last
token): the MLA latent rows of positions `[start, n)` and, for every KDA layer, the live slot's
conv tail and recurrent state at `n`. `start` is what the receiving side already holds: the
longest run of whole match units its prefix cache has MLA pages for (no checkpoint is needed
there, the state at `n` comes with the transfer).

`Region`s are byte ranges of pool tensors, listed in one canonical order (MLA layers, then
positions in runs that stay inside a page; then per KDA layer and per head block the tail's
pieces (each conv row's q, k and v channels of the block's heads), then the block's state), so
a sender and a receiver with compatible layouts (`handoff_fingerprint`) list the same ranges,
each side over its own pages and slot. `region_digests` hashes them per MLA layer and per (KDA
layer, head block), in that order. Under tensor parallelism every rank's pools have rank 0's
shapes (heads split evenly), so every rank lists the same ranges over its own bytes
(`engine.exec.rank_transfer`). Head blocks let instances of other tensor-parallel sizes meet:
with B blocks over all heads (a multiple of both sizes) a rank of a W-rank instance holds B/W of
them, and block b is the same bytes, in the same order, wherever it lives.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .checkpoint_tag import STATE_LAYOUT_VERSION
from .hashing import root_hash
from .kda_pool import KdaStatePool
from .manager import CacheManager, SeqCache
from .mla_pool import MlaPagePool


@dataclass(frozen=True)
class Region:
    """`length` bytes at `offset` into pool tensor `tensor` ("mla", "tails" or "states"); `layer`
    is the pool's layer index (MLA or KDA) the bytes belong to."""

    tensor: str
    layer: int
    offset: int
    length: int
    block: int = -1  # a KDA region's head block on this rank (0 .. blocks-1); -1 for MLA rows


def layout_fingerprint(cache: CacheManager, world: int = 1) -> str:
    """Hex sha256 over what makes two instances' pools byte-compatible, rank for rank: the number
    of tensor-parallel ranks (each holds its share of the KDA heads), the KDA state fingerprint
    (model, dtypes, a rank's shapes, kernel path) and the MLA pool's layers, page size, row width,
    dtype and rows per page (decode context parallelism changes the latter)."""
    m = cache.mla
    h = hashlib.sha256(cache.fingerprint)
    h.update(repr((world, m.layer_ids, m.page_size, m.rows_per_page, m.row_dim, str(m.storage.dtype))).encode())
    h.update(repr(cache.kda.layer_ids).encode())
    return h.hexdigest()


def handoff_fingerprint(cache: CacheManager, world: int = 1) -> str:
    """Hex sha256 over what makes two instances' handoffs byte-compatible whatever their
    tensor-parallel sizes: the model (`model_id`), the KDA pools' dtypes and whole-model shapes
    (a rank's heads times `world`), the state layout version, the kernel path, and the MLA pool's
    layers, page size, row width and dtype."""
    m, k = cache.mla, cache.kda
    h = hashlib.sha256(b"deltaserve-handoff")
    tails = (k.tails.shape[0], k.tails.shape[2], k.tails.shape[3] * world)
    states = (k.states.shape[0], k.states.shape[2] * world, *k.states.shape[3:])
    parts = (cache.model_id, str(k.tails.dtype), str(k.states.dtype), tails, states, STATE_LAYOUT_VERSION)
    h.update(repr((*parts, cache.kernel, k.layer_ids)).encode())
    h.update(repr((m.layer_ids, m.page_size, m.rows_per_page, m.row_dim, str(m.storage.dtype))).encode())
    return h.hexdigest()


def prompt_hash(model_id: str, cache_salt: str | None, tokens: list[int], images: tuple[bytes, ...] = ()) -> str:
    """Hex sha256 naming an exact token sequence under a model and salt, with the digests of the
    images in it (the handoff's prefix)."""
    h = hashlib.sha256(root_hash(model_id, cache_salt))
    h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
    for d in images:
        h.update(d)
    return h.hexdigest()


def mla_regions(pool: MlaPagePool, pages: list[int], start: int, stop: int) -> list[Region]:
    """Rows of positions `[start, stop)` of a sequence whose block table is `pages`, per layer,
    in runs that end at page boundaries (rows of one page are contiguous)."""
    if pool.dcp_world != 1:
        raise ValueError("handoffs need whole MLA pages on one rank (no decode context parallelism)")
    ps, row = pool.page_size, pool.row_dim * pool.storage.dtype.itemsize
    runs = []
    t = start
    while t < stop:
        end = min(stop, (t // ps + 1) * ps)
        runs.append((pages[t // ps] * ps + t % ps, end - t))
        t = end
    per_layer = pool.num_pages * ps
    return [Region("mla", i, (i * per_layer + r) * row, n * row) for i in range(len(pool.layer_ids)) for r, n in runs]


def kda_regions(pool: KdaStatePool, slot: int, blocks: int = 1) -> list[Region]:
    """The conv tail `[W-1, 3P]` (q, k, v channels, each head-major) and recurrent state
    `[H, K, V]` of `slot`, per KDA layer, in `blocks` head blocks of this rank's H heads: per
    block the tail's `3 (W-1)` pieces, then its state. `ValueError` if the heads do not divide."""
    n, heads = pool.num_slots, pool.states.shape[2]
    rows, width = pool.tails.shape[2], pool.tails.shape[3]
    if blocks < 1 or heads % blocks or width % (3 * blocks):
        raise ValueError(f"{heads} KDA heads on a rank do not split into {blocks} blocks")
    ti, si = pool.tails.dtype.itemsize, pool.states.dtype.itemsize
    state = pool.states[0, 0].numel()
    part, piece, block_state = width // 3, width // (3 * blocks), state // blocks
    out = []
    for i in range(len(pool.layer_ids)):
        tail0, state0 = (i * n + slot) * rows * width, (i * n + slot) * state
        for j in range(blocks):
            for w, q in ((w, q) for w in range(rows) for q in range(3)):
                out.append(Region("tails", i, (tail0 + w * width + q * part + j * piece) * ti, piece * ti, j))
            out.append(Region("states", i, (state0 + j * block_state) * si, block_state * si, j))
    return out


def handoff_regions(cache: CacheManager, seq_id: int, start: int, stop: int, blocks: int = 1) -> list[Region]:
    """Every region a handoff of sequence `seq_id` over `[start, stop)` moves, canonical order."""
    sc = cache.seqs[seq_id]
    return mla_regions(cache.mla, sc.pages, start, stop) + kda_regions(cache.kda, sc.slot, blocks)


def pool_tensors(mla: MlaPagePool, kda: KdaStatePool) -> dict[str, torch.Tensor]:
    """The pool tensors regions point into (what a transfer engine registers): a rank's own."""
    return {"mla": mla.storage, "tails": kda.tails, "states": kda.states}


def digest_key(region: Region, first_block: int = 0) -> str:
    """ "mla/<layer>" or "kda/<layer>/<block>": the block numbered from `first_block` (the rank's
    first head block among all of them), so keys name the same bytes on every instance."""
    if region.tensor == "mla":
        return f"mla/{region.layer}"
    return f"kda/{region.layer}/{first_block + region.block}"


def region_digests(tensors: dict[str, torch.Tensor], regions: list[Region], first_block: int = 0) -> dict[str, str]:
    """One blake2b digest per MLA layer and per (KDA layer, head block) (`digest_key`), over
    those regions of `tensors` (`pool_tensors`) in order. Host pools are hashed in place; device
    pools copy each key's regions to the host in one transfer."""
    flat = {k: t.view(-1).view(torch.uint8) for k, t in tensors.items()}
    keys: dict[str, list[torch.Tensor]] = {}
    for r in regions:
        keys.setdefault(digest_key(r, first_block), []).append(flat[r.tensor][r.offset : r.offset + r.length])
    return {k: digest(parts) for k, parts in keys.items()}


def digest(parts: list[torch.Tensor], copy: bool | None = None) -> str:
    """blake2b of the byte tensors `parts` in order: read in place, or (`copy`, the default for
    device tensors) gathered and copied to the host once."""
    h = hashlib.blake2b(digest_size=16)
    if copy is None:
        copy = any(p.device.type != "cpu" for p in parts)
    for p in [torch.cat(parts).cpu()] if copy and parts else parts:
        h.update(p.numpy())
    return h.hexdigest()


def expected_bytes(cache: CacheManager, num_tokens: int) -> int:
    """Bytes a handoff of `num_tokens` MLA positions plus one KDA state moves."""
    m, k = cache.mla, cache.kda
    mla = len(m.layer_ids) * num_tokens * m.row_dim * m.storage.dtype.itemsize
    state = k.tails[:, 0].numel() * k.tails.dtype.itemsize + k.states[:, 0].numel() * k.states.dtype.itemsize
    return mla + state


def admit_received(
    cache: CacheManager,
    seq_id: int,
    tokens: list[int],
    num_received: int,
    cache_salt: str | None = None,
    spans: tuple[tuple[int, int, bytes], ...] = (),
) -> int | None:
    """Admit a sequence whose first `num_received` tokens arrive by handoff: it shares the MLA
    pages of the longest unit-aligned prefix cached here (at most `num_received` tokens), gets
    fresh pages up to `len(tokens)` and a zeroed live slot for the incoming state. Returns the
    number of tokens covered by shared pages (where the transfer starts), or None if the pools
    are short (nothing taken). The caller writes rows `[start, num_received)` and the state,
    then runs the sequence from `num_received`, or frees it with `cache.free(seq_id)`. `spans`:
    the prompt's image spans (the unit hashes' extra keys, as the sequence commits them)."""
    if seq_id in cache.seqs:
        raise RuntimeError(f"sequence {seq_id} already holds cache")
    if cache.kda.num_free == 0:
        return None
    k, hashes, root = 0, [], b""
    if cache.index is not None:
        hit = cache.lookup(tokens[: num_received + 1], cache_salt, spans=spans)
        hashes, root, k = list(hit.hashes), hit.root, hit.k_mla
        cache.index.touch(hashes, k)
    shared = cache.index.pages_of(hashes, k) if k else []
    cache.mla.incref(shared)
    fresh = cache._take_pages(cache.mla.pages_for(len(tokens)) - len(shared))
    if fresh is None:
        cache.mla.release(shared)
        return None
    cache.seqs[seq_id] = SeqCache(
        cache.kda.allocate(), shared + fresh, root, len(tokens), hashes[:k], k, chain=tuple(hashes), received=True
    )
    start = k * cache.policy.unit if k else 0
    cache.counters["received"] += 1
    cache.counters["received_hit_tokens"] += start
    return start


def admit_fork(cache: CacheManager, src_id: int, seq_id: int) -> bool:
    """Admit `seq_id` as a fork of the received sequence `src_id` (another sample of its prompt,
    `n > 1`): it shares the pages whose every row lies before the last prompt token, and takes a
    fresh slot and fresh pages for the rest; False (nothing taken) if the pools are short. The
    received bytes reach it by `copy_fork` once they have landed in `src_id`'s cache."""
    if seq_id in cache.seqs:
        raise RuntimeError(f"sequence {seq_id} already holds cache")
    src = cache.seqs[src_id]
    full = (src.prompt_len - 1) // cache.page_size
    if cache.kda.num_free == 0:
        return False
    fresh = cache._take_pages(cache.mla.pages_for(src.prompt_len) - full)
    if fresh is None:
        return False
    cache.mla.incref(src.pages[:full])
    cache.seqs[seq_id] = SeqCache(
        cache.kda.allocate(),
        src.pages[:full] + fresh,
        src.root,
        src.prompt_len,
        list(src.hashes),
        src.registered,
        chain=src.chain,
        received=True,
    )
    return True


def copy_fork(cache: CacheManager, src_id: int, seq_id: int) -> None:
    """Give fork `seq_id` what `src_id` received: the rows of the partial page before the last
    prompt token and the KDA state (both journaled for the other ranks)."""
    src, dst = cache.seqs[src_id], cache.seqs[seq_id]
    full = (src.prompt_len - 1) // cache.page_size
    if (src.prompt_len - 1) % cache.page_size:
        cache.mla.copy_page(src.pages[full], dst.pages[full])
    cache.kda.copy_from(cache.kda, src.slot, dst.slot)
