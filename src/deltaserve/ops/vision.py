"""Vision-tower ops (spec/model.md §12.2-12.5): RoPE2D, per-image attention, the learned
position table's bilinear resize, the `sd2_tpool` merge and the two GELUs.

Images are packed along the token dim: image i owns `lengths[i]` consecutive rows, its patches
row-major over its `(h, w)` grid. Attention runs image by image in bounded query chunks, so no
op here allocates more than linearly in the patches (`SCORE_BYTES` bounds the one quadratic
term). Nothing here loops over heads.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def grid_positions(
    grid_hws: list[tuple[int, int]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every packed patch (int64 [L] each), row-major within each image."""
    rows, cols = [], []
    for h, w in grid_hws:
        flat = torch.arange(h * w, device=device)
        rows.append(flat // w)
        cols.append(flat % w)
    return torch.cat(rows), torch.cat(cols)


def rope2d_cos_sin(
    rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE2D (§12.3) cos/sin `[L, head_dim/2]`, one column per adjacent pair `(2m, 2m+1)`.
    Pair `2i` turns by `col * theta^(-4i/head_dim)`, pair `2i+1` by `row * ...` (column
    first, as the checkpoint was trained). Angles are formed in `dtype` (fp32 as upstream)."""
    if head_dim % 4:
        raise ValueError(f"RoPE2D needs a head dim divisible by 4, got {head_dim}")
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, device=rows.device, dtype=dtype) / head_dim)
    angles = torch.stack([torch.outer(cols.to(dtype), freqs), torch.outer(rows.to(dtype), freqs)], dim=-1)
    angles = angles.flatten(1)  # [L, head_dim/2]: (col f0, row f0, col f1, row f1, ...)
    return angles.cos(), angles.sin()


def apply_rope2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair of `x [L, H, D]` as a complex number by the angle whose
    cos/sin `[L, D/2]` gives, computed in (at least) fp32; the result has x's dtype."""
    xf = x.to(_acc(x.dtype)).unflatten(-1, (-1, 2))
    re, im = xf.unbind(-1)
    c, s = cos[:, None].to(xf.dtype), sin[:, None].to(xf.dtype)
    return torch.stack([re * c - im * s, re * s + im * c], dim=-1).flatten(-2).to(x.dtype)


SCORE_BYTES = 32 << 20  # most bytes of one attention call's scores (fp32), were SDPA to form them


def query_chunk(n_keys: int, heads: int, max_bytes: int = SCORE_BYTES) -> int:
    """Query rows per attention call so that `rows x n_keys x heads` fp32 scores stay within
    `max_bytes` (at least one row): the bound holds whichever SDPA backend runs."""
    return max(1, max_bytes // (4 * max(1, n_keys) * heads))


def image_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_bytes: int = SCORE_BYTES) -> torch.Tensor:
    """Bidirectional attention of ONE image's rows: `q [M, H, D]` against `k, v [N, H, D]` ->
    `[M, H, D]`, scale `D^-1/2`, no mask. Queries go in chunks of `query_chunk` rows, so the
    memory is linear in `M + N` (scores at most `max_bytes` per call); each row is exact (a row's
    softmax never sees another chunk). 4-D operands, so SDPA may pick its fused kernel."""
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    step = query_chunk(k.shape[0], k.shape[1], max_bytes)
    parts = [
        F.scaled_dot_product_attention(q[a : a + step].transpose(0, 1)[None], kt, vt)[0].transpose(0, 1)
        for a in range(0, q.shape[0], step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], max_bytes: int = SCORE_BYTES
) -> torch.Tensor:
    """Attention of packed images (`[L, H, D]`, image i owns `lengths[i]` rows in order), each
    image attending only to itself (block-diagonal, never a dense `[L, L]` mask)."""
    bounds = [0, *itertools.accumulate(lengths)]
    return torch.cat([image_attention(q[a:b], k[a:b], v[a:b], max_bytes) for a, b in itertools.pairwise(bounds)])


def interp_pos_emb(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Learned position table `[H0, W0, D]` resized to the grid `(h, w)` (bilinear, default
    align_corners), flattened row-major to `[h*w, D]`; the table itself where it already fits."""
    if tuple(table.shape[:2]) == (h, w):
        return table.flatten(0, 1)
    grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear")
    return grid[0].permute(1, 2, 0).flatten(0, 1)


def sd2_tpool(x: torch.Tensor, grid_thws: list[tuple[int, int, int]], kernel: tuple[int, int] = (2, 2)) -> torch.Tensor:
    """`sd2_tpool` merge (§12.4): packed `[sum t*h*w, D]` -> `[sum (h/kh)*(w/kw), kh*kw*D]`.
    Each output row concatenates one window row-major (row0 col0, row0 col1, row1 col0, ...),
    averaged over time; images stay in order."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grid_thws:
        if h % kh or w % kw:
            raise ValueError(f"grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
        n = t * h * w
        img = x[start : start + n].reshape(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5)
        out.append(img.mean(0).reshape((h // kh) * (w // kw), -1))
        start += n
    return torch.cat(out)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximate GELU (`gelu_pytorch_tanh`, the tower MLP)."""
    return F.gelu(x, approximate="tanh")


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU (the projector)."""
    return F.gelu(x)
