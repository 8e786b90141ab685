"""Small building blocks whose parameter names match the checkpoint (`<name>.weight`)."""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from ..kernels.cpu import NativeKernels, native
from ..ops.attn_res import ATTN_RES_EPS, attn_res_mix
from ..ops.linear import linear
from ..ops.norms import rms_norm


_PINNED: ContextVar[int | None] = ContextVar("deltaserve_pinned_weights", default=None)
_EPOCHS = itertools.count(1)
_registrations = [0]   # parameters and buffers registered on any module so far (the hooks count them)


def _count_registration(module, name, tensor):
    _registrations[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_registration)


@contextmanager
def weights_pinned(model: nn.Module):
    """For one forward pass of `model`: one stamp of all its parameters and buffers (storage and
    in-place version; MXFP4 experts are buffers) is taken here, and while it equals the previous
    pass's, `cached_object` returns what it validated under that stamp without re-stamping the
    sources (the per-call stamps of the decode plans cost more than their native calls save
    otherwise). The tensor list is re-walked only after a parameter or buffer was (re)registered
    somewhere. Weights must not change inside the block."""
    params = model.__dict__.get("_pinned_params")
    if params is None or params[0] != _registrations[0]:
        params = model.__dict__["_pinned_params"] = (_registrations[0], [*model.parameters(), *model.buffers()])
    try:
        stamp = tuple((p.data_ptr(), p._version) for p in params[1])
    except RuntimeError:   # inference tensors carry no version counter: nothing is pinned
        yield
        return
    state = model.__dict__.get("_pinned_stamp")
    if state is None or state[0] != stamp:
        state = model.__dict__["_pinned_stamp"] = (stamp, next(_EPOCHS))
    token = _PINNED.set(state[1])
    try:
        yield
    finally:
        _PINNED.reset(token)


def cached_object(owner: nn.Module, key: str, build, *sources):
    """`build()` memoised on `owner` until a source changes (storage or in-place version), so
    per-step kernels do not re-derive what depends only on weights. `sources` are tensors (None
    skipped), or one callable returning them (not called under `weights_pinned` once validated).
    Plain attributes, not buffers: never saved or counted."""
    memo = owner.__dict__.setdefault("_derived_memo", {})
    hit = memo.get(key)
    epoch = _PINNED.get()
    if hit is not None and epoch is not None and hit[2] == epoch:
        return hit[1]
    if len(sources) == 1 and callable(sources[0]):
        sources = sources[0]()
    stamp = tuple((t.data_ptr(), t._version) for t in sources if t is not None)
    if hit is None or hit[0] != stamp:
        with torch.no_grad():
            hit = (stamp, build(), epoch)
    memo[key] = (stamp, hit[1], epoch)
    return hit[1]


def cached_derived(owner: nn.Module, key: str, build, *sources: torch.Tensor) -> torch.Tensor:
    """`cached_object` of a contiguous tensor derived from `sources` (a dtype cast, a transposed copy)."""
    return cached_object(owner, key, lambda: build().contiguous(), *sources)


def cached_fp32(owner: nn.Module, key: str, build, *sources: torch.Tensor) -> torch.Tensor:
    """`cached_derived` of an fp32 value."""
    return cached_derived(owner, key, lambda: build().float(), *sources)


def project(x: torch.Tensor, *layers: nn.Linear, f32: tuple[bool, ...] | None = None) -> list[torch.Tensor]:
    """`[layer(x) for layer in layers]` (outputs where `f32[i]` are the fp32 `x.float() @ w.float().T`
    instead); bf16 batches on CPU of up to `multi_rows` rows (MAX_ROWS, or AMX_ROWS with AMX tiles)
    run all of them as one native call, so the projections of one input share a single pass of the
    threads over their weights."""
    f32 = f32 or (False,) * len(layers)
    rows = x.shape[0] if x.dim() == 2 else 0
    if x.dtype == torch.bfloat16 and rows > 0 and len(layers) <= NativeKernels.MAX_MULTI and \
            all(m.weight.dtype == torch.bfloat16 and m.weight.is_contiguous() for m in layers):
        kernels = native(x.device)
        if kernels is not None and rows <= kernels.multi_rows(x.shape[1]):
            return kernels.linear_bf16_multi(x, [m.weight for m in layers], list(f32))
    return [x.float() @ m.weight.float().T if f else m(x) for m, f in zip(layers, f32)]


class Linear(nn.Linear):
    """Bias-free `nn.Linear` whose forward takes the small-M native path (`ops.linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def empty_linear(in_features: int, out_features: int) -> Linear:
    """A bias-free linear layer (every linear layer in this family is bias-free)."""
    return Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    """KimiRMSNorm with an explicit eps (each use site has its own, spec §3)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def weight_f32(self) -> torch.Tensor:
        """The weight in fp32, memoised (what the native kernels take)."""
        return cached_fp32(self, "w", lambda: self.weight, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1:
            kernels = native(x.device)
            if kernels is not None:
                return kernels.rms_norm(x, self.weight_f32(), self.eps)
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class WeightVector(nn.Module):
    """A lone `weight` tensor (AttnRes projections [1, D] and score norms [D])."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*shape))

    def flat(self) -> torch.Tensor:
        return self.weight.reshape(-1)


def attn_res(cur: torch.Tensor, bank: list[torch.Tensor], proj: WeightVector, norm: WeightVector,
             then: RMSNorm | None = None) -> torch.Tensor:
    """`ops.attn_res.attn_res_mix(cur, bank, proj, norm)`, then `then` (the layer's next RMSNorm)
    if given; one native call for bf16 on CPU (the same values as the two ops in turn)."""
    if not bank:
        return cur if then is None else then(cur)
    kernels = native(cur.device) if cur.dtype == torch.bfloat16 and cur.dim() == 2 else None
    if kernels is not None and len(bank) < kernels.MAX_MIX:
        q = cached_fp32(proj, "mix_q", lambda: norm.flat().float() * proj.flat().float(), proj.weight, norm.weight)
        if then is None:
            return kernels.attn_res_mix([*bank, cur], q, ATTN_RES_EPS)
        return kernels.attn_res_mix([*bank, cur], q, ATTN_RES_EPS, then.weight_f32(), then.eps)
    mixed = attn_res_mix(cur, bank, proj.flat(), norm.flat())
    return mixed if then is None else then(mixed)
