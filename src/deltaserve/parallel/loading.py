"""Reading one tensor-parallel rank's chunk of a checkpoint tensor without materialising the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import nn

from .context import SINGLE, ParallelContext


class ShardError(ValueError):
    """A checkpoint tensor does not split into the tensor-parallel size along its shard dim."""


def chunk_bounds(size: int, dim: int, tp: ParallelContext, name: str) -> slice:
    """This rank's rows of a dim of `size` (MXFP4 scales: the intermediate size must then be a
    multiple of 32 * world, since a rank's chunk must hold whole 32-element groups)."""
    if size % tp.world:
        hint = " (MXFP4 experts split by whole 32-element groups)" if name.endswith("_scale") else ""
        raise ShardError(
            f"{name}: dim {dim} of size {size} does not split into {tp.world} tensor-parallel shards{hint}"
        )
    n = size // tp.world
    return slice(tp.rank * n, (tp.rank + 1) * n)


def read_shard(f, name: str, dim: int, tp: ParallelContext) -> torch.Tensor:
    """Rank `tp.rank`'s chunk along `dim` of tensor `name` in the open safetensors file `f`,
    read through `get_slice` (the file is memory-mapped: only the chunk is copied, into its own
    contiguous storage). A tensor with fewer dims is read whole, for validation to report its
    shape."""
    part = f.get_slice(name)
    shape = part.get_shape()
    if dim >= len(shape):
        return f.get_tensor(name)
    return part[(slice(None),) * dim + (chunk_bounds(shape[dim], dim, tp, name),)].contiguous()


def group_units(name: str, dim: int, ndim: int) -> int:
    """Units of a checkpoint tensor's `dim` per 32-element MXFP4 group of the logical width: 16
    packed bytes or 1 scale along the input (last) dim, else 32 rows or columns."""
    if dim == ndim - 1 and name.endswith("weight_packed"):
        return 16
    if dim == ndim - 1 and name.endswith("weight_scale"):
        return 1
    return 32


def read_padded_shard(f, name: str, dim: int, tp: ParallelContext) -> torch.Tensor:
    """Rank `tp.rank`'s chunk along `dim` of `name` with that dim zero-padded to whole 32-element
    groups on every rank (`group_units`): the dim's size rounded up to a multiple of groups x
    world, then cut in `world` equal chunks; a chunk past the tensor's end is zeros. Zero weights
    (zero MXFP4 codes) in a GLU expert's padded intermediate columns add exactly nothing."""
    part = f.get_slice(name)
    shape = part.get_shape()
    if dim >= len(shape):
        return f.get_tensor(name)
    g = group_units(name, dim, len(shape))
    size = shape[dim]
    chunk = -(-size // (g * tp.world)) * g
    lo = min(tp.rank * chunk, size)
    hi = min(lo + chunk, size)
    real = part[(slice(None),) * dim + (slice(lo, hi),)]
    out = torch.zeros(*shape[:dim], chunk, *shape[dim + 1 :], dtype=real.dtype)
    out.narrow(dim, 0, hi - lo).copy_(real)
    return out


def take_shard(t: torch.Tensor, dim: int, tp: ParallelContext, name: str) -> torch.Tensor:
    """Rank `tp.rank`'s chunk along `dim` of a tensor already read, as its own storage."""
    return t[(slice(None),) * dim + (chunk_bounds(t.shape[dim], dim, tp, name),)].clone()


def _no_stack(name: str) -> str | None:
    return None


@dataclass(frozen=True)
class ShardReader:
    """Which chunk of each checkpoint tensor (by text name) this rank reads. `dims`: parameter
    name -> the dim its shard splits (empty: every tensor whole); `sizes`: its size along that dim
    on this rank. `stack_of(name)`: the stacked parameter one routed expert's tensor joins (its
    split dim is the stack's less the expert dim), else None. A stack split along dim 0 is split
    by expert: this rank holds its experts `experts_held(stack)` whole, and the per-expert tensors
    of other ranks' experts are never read. Names ending in `read_whole` are read whole and cut by
    `local` after mapping (A_log: H floats, stored padded or 4-D). Stacks in `padded` (MXFP4
    experts whose width per rank is not whole 32-element groups) read their expert tensors
    zero-padded to whole groups per rank (`read_padded_shard`)."""

    tp: ParallelContext = SINGLE
    dims: dict[str, int] = field(default_factory=dict)
    stack_of: Callable[[str], str | None] = _no_stack
    read_whole: tuple[str, ...] = (".A_log",)
    sizes: dict[str, int] = field(default_factory=dict)
    padded: frozenset[str] = frozenset()

    @classmethod
    def of(cls, model: nn.Module, tp: ParallelContext, stack_of: Callable[[str], str | None]) -> ShardReader:
        """The reader of `model` built for `tp` (its parameters marked by `context.shard`)."""
        if tp.world == 1 and tp.expert_world == 1:
            return cls()
        marked = [(n, p) for n, p in model.named_parameters() if hasattr(p, "tp_dim")]
        if tp.world == 1:  # wide expert parallelism: only the routed experts are split (by expert)
            marked = [(n, p) for n, p in marked if p.tp_dim == 0 and ".experts." in n]
        dims = {n: p.tp_dim for n, p in marked}
        padded = frozenset(n for n, p in marked if getattr(p, "tp_padded", False))
        return cls(tp, dims, stack_of, sizes={n: p.shape[p.tp_dim] for n, p in marked}, padded=padded)

    def dim(self, name: str) -> int | None:
        stack = self.stack_of(name)
        if stack is None:
            return self.dims.get(name)
        stacked = self.dims.get(stack)
        return None if not stacked else stacked - 1  # split by expert (0): each expert read whole

    def experts_held(self, stack: str) -> range | None:
        """The experts of stacked parameter `stack` this rank holds where it is split by expert
        (rank r of W = `tp.expert_world`: [r * E/W, (r + 1) * E/W)), else None (every expert)."""
        if self.dims.get(stack) != 0:
            return None
        n, r = self.sizes[stack], self.tp.expert_rank
        return range(r * n, (r + 1) * n)

    def held_elsewhere(self, stack: str, expert: int) -> bool:
        """True for an expert of `stack` another rank holds (its tensors are skipped unread); an
        index beyond every rank's experts is not, so validation reports it."""
        held = self.experts_held(stack)
        return held is not None and expert not in held and 0 <= expert < len(held) * self.tp.expert_world

    def reader(self, f, raw_name: str, name: str) -> Callable[[], torch.Tensor]:
        """A thunk reading this rank's part of `raw_name` from the open file `f`."""
        dim = self.dim(name)
        if dim is None or name.endswith(self.read_whole):
            return partial(f.get_tensor, raw_name)
        if self.stack_of(name) in self.padded:
            return partial(read_padded_shard, f, raw_name, dim, self.tp)
        return partial(read_shard, f, raw_name, dim, self.tp)

    def local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of `t`, a tensor `reader` read whole (`t` itself if unsharded)."""
        dim = self.dim(name)
        return t if dim is None else take_shard(t, dim, self.tp, name)
