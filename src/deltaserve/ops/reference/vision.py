"""Naive oracle for the K3 vision path (spec/model.md §12.2-12.5), written from the spec alone:
explicit loops over rotation pairs, images and heads, a hand-written bilinear resize, explicit
softmax and window gather. Computes in the dtype it is given (pass float64). Never used in the
serving path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PREFIX = "vision_tower."


def naive_rms_norm(x, weight, eps):
    """`x / sqrt(mean(x^2) + eps) * w` (no intermediate casts: for float64 inputs)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def naive_gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def naive_gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def naive_grid_rows_cols(h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an `h x w` grid, row-major."""
    rows = torch.tensor([r for r in range(h) for _ in range(w)])
    cols = torch.tensor([c for _ in range(h) for c in range(w)])
    return rows, cols


def naive_rope2d(x, rows, cols, theta=10000.0):
    """§12.3 on `x [L, H, D]`: pair m = (2m, 2m+1) is a complex number turned by
    `col * theta^(-4i/D)` for m = 2i and by `row * theta^(-4i/D)` for m = 2i+1."""
    d = x.shape[-1]
    out = x.clone()
    for m in range(d // 2):
        i = m // 2
        pos = (cols if m % 2 == 0 else rows).to(x.dtype)
        angle = pos * theta ** (-4.0 * i / d)
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        a, b = x[..., 2 * m], x[..., 2 * m + 1]
        out[..., 2 * m] = a * c - b * s
        out[..., 2 * m + 1] = a * s + b * c
    return out


def _source_index(n_out: int, n_in: int) -> list[tuple[int, int, float]]:
    """Bilinear, align_corners=False: `src = (dst + 0.5) * n_in / n_out - 0.5`, clamped at 0."""
    taps = []
    for dst in range(n_out):
        src = max((dst + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = int(math.floor(src))
        taps.append((i0, min(i0 + 1, n_in - 1), src - i0))
    return taps


def naive_bilinear(table, h, w):
    """Position table `[H0, W0, D]` resized to `[h*w, D]` (row-major), by the formula."""
    rows, cols = _source_index(h, table.shape[0]), _source_index(w, table.shape[1])
    out = []
    for r0, r1, a in rows:
        for c0, c1, b in cols:
            top = (1 - b) * table[r0, c0] + b * table[r0, c1]
            bottom = (1 - b) * table[r1, c0] + b * table[r1, c1]
            out.append((1 - a) * top + a * bottom)
    return torch.stack(out)


def naive_attention(q, k, v):
    """Bidirectional attention of ONE image, head by head: `[L, H, D]` -> `[L, H, D]`."""
    out = torch.empty_like(q)
    for head in range(q.shape[1]):
        s = q[:, head] @ k[:, head].T / math.sqrt(q.shape[-1])
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        out[:, head] = (e / e.sum(-1, keepdim=True)) @ v[:, head]
    return out


def naive_merge(x, grid_thws, kernel=(2, 2)):
    """sd2_tpool by explicit gather: for each window, concatenate its rows row-major (row0
    col0, row0 col1, ..., row1 col0, ...) and average over time; images in order."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grid_thws:
        for r in range(h // kh):
            for c in range(w // kw):
                frames = []
                for f in range(t):
                    base = start + f * h * w
                    cells = [x[base + (r * kh + i) * w + c * kw + j] for i in range(kh) for j in range(kw)]
                    frames.append(torch.cat(cells))
                out.append(torch.stack(frames).mean(0))
        start += t * h * w
    return torch.stack(out)


def naive_tower_image(weights, patches, h, w, heads, eps, theta=10000.0):
    """One image's MoonViT3d states `[h*w, D]` from the §12.2 tensors (`weights`: checkpoint
    name -> tensor); the pre-norm block loop written out."""
    wt = {k[len(PREFIX) :]: v for k, v in weights.items() if k.startswith(PREFIX)}
    x = F.conv2d(patches, wt["patch_embed.proj.weight"], stride=patches.shape[-1]).flatten(1)
    x = x + naive_bilinear(wt["patch_embed.pos_emb.weight"], h, w)
    rows, cols = naive_grid_rows_cols(h, w)
    n_blocks = len({k.split(".")[2] for k in wt if k.startswith("encoder.blocks.")})
    for i in range(n_blocks):
        b = {k[len(f"encoder.blocks.{i}.") :]: v for k, v in wt.items() if k.startswith(f"encoder.blocks.{i}.")}
        a = naive_rms_norm(x, b["norm0.weight"], eps)
        q, k, v = (a @ b["wqkv.weight"].T).chunk(3, dim=-1)
        q, k, v = (t.reshape(t.shape[0], heads, -1) for t in (q, k, v))
        q, k = naive_rope2d(q, rows, cols, theta), naive_rope2d(k, rows, cols, theta)
        x = x + naive_attention(q, k, v).reshape(x.shape[0], -1) @ b["wo.weight"].T
        hid = naive_gelu_tanh(naive_rms_norm(x, b["norm1.weight"], eps) @ b["mlp.fc0.weight"].T)
        x = x + hid @ b["mlp.fc1.weight"].T
    return naive_rms_norm(x, wt["encoder.final_layernorm.weight"], eps)


def naive_vision(weights, patches, grid_thws, heads, eps, projector_eps, kernel=(2, 2), theta=10000.0):
    """Packed images -> {"tower": [L, D], "merged": [N, kh*kw*D], "out": [N, text_hidden]},
    each image run alone (no cross-image attention by construction)."""
    towers, start = [], 0
    for t, h, w in grid_thws:
        if t != 1:
            raise ValueError("the reference covers images (t = 1) only")
        towers.append(naive_tower_image(weights, patches[start : start + h * w], h, w, heads, eps, theta))
        start += h * w
    tower = torch.cat(towers)
    merged = naive_merge(tower, grid_thws, kernel)
    hid = naive_gelu_erf(merged @ weights["mm_projector.proj.0.weight"].T)
    out = naive_rms_norm(
        hid @ weights["mm_projector.proj.2.weight"].T, weights["mm_projector.post_norm.weight"], projector_eps
    )
    return {"tower": tower, "merged": merged, "out": out}
