"""Packed-sequence chunk plans shared by the chunked KDA kernels (`cpu/kda.py`) and the PyTorch
path they are checked against (`ops.kda.kda_chunked`), so every implementation cuts the same
chunks at the same export offsets; and the shift-based exclusive cumsum both use."""

from __future__ import annotations

import torch

from .transfer import host_copy

__all__ = ["checked_cu_seqlens", "chunk_plan", "excl_cumsum"]


def excl_cumsum(x: torch.Tensor, dim: int, reverse: bool = False) -> torch.Tensor:
    """Exclusive (reverse) cumulative sum by shifting, never by subtracting."""
    if reverse:
        return excl_cumsum(x.flip(dim), dim).flip(dim)
    out = torch.zeros_like(x)
    n = x.shape[dim]
    out.narrow(dim, 1, n - 1).copy_(x.narrow(dim, 0, n - 1).cumsum(dim))
    return out


def checked_cu_seqlens(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """`cu_seqlens` as a CPU int64 tensor (its `host_copy`: no read from a device); ValueError
    unless it rises from 0 to n."""
    cu = host_copy(cu_seqlens).to(torch.long)
    if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must rise from 0 to N")
    return cu


def chunk_plan(cu: torch.Tensor, export_offsets, chunk: int):
    """Cut sequences at export offsets into segments and segments into chunks of <= `chunk`.
    Returns chunk starts/lengths/sequence/position (global token order, ends strictly
    increasing) and, for exports, the flat index of the chunk ending at each offset."""
    lens = cu[1:] - cu[:-1]
    cuts = [cu]
    ex_end = None
    if export_offsets is not None:
        if len(export_offsets) != lens.numel():
            raise ValueError("export_offsets needs one list per sequence")
        seq = [b for b, offs in enumerate(export_offsets) for _ in offs]
        offs = torch.tensor([o for e in export_offsets for o in e], dtype=torch.long)
        seq = torch.tensor(seq, dtype=torch.long)
        if offs.numel() and bool(((offs <= 0) | (offs > lens[seq])).any()):
            raise ValueError("export offsets must satisfy 0 < o <= len_b")
        ex_end = cu[seq] + offs
        cuts.append(ex_end)
    bnd = torch.unique(torch.cat(cuts))  # sorted segment boundaries
    seg_len = bnd[1:] - bnd[:-1]
    per_seg = (seg_len + chunk - 1) // chunk
    nc = int(per_seg.sum())
    seg_of = torch.repeat_interleave(torch.arange(seg_len.numel()), per_seg, output_size=nc)
    first = excl_cumsum(per_seg, 0)
    start = bnd[seg_of] + chunk * (torch.arange(nc) - first[seg_of])
    length = torch.minimum(bnd[seg_of + 1] - start, torch.tensor(chunk))
    seq_of = torch.searchsorted(cu[1:], start, right=True)
    n_chunks = torch.bincount(seq_of, minlength=lens.numel())
    pos = torch.arange(nc) - excl_cumsum(n_chunks, 0)[seq_of]
    ex_chunk = None if ex_end is None else torch.searchsorted(start + length, ex_end)
    return start, length, seq_of, pos, n_chunks, ex_chunk
