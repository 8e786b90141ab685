"""Routed MXFP4 experts on OpenAI's `triton_kernels` grouped GEMM (`matmul_ogs`), imported lazily.

The contract of `triton.moe.grouped_experts` (x [N, D] bf16, ids / weights [N, k] -> [N, D] bf16)
as two `matmul_ogs` calls over the (token, slot) pairs sorted by expert:
  1. gate/up: the pairs' rows of x gathered (`GatherIndx`) against W13 = rows of W1 and W3
     interleaved (gate at even, up at odd output columns, as the library's own SwiGLU expects), with
     our activation fused (`FusedActivation`, reduction_n 2): g and u rounded to bf16, SiTU or
     SwiGLU in fp32 as `triton.moe` computes it, h stored in bf16;
  2. down: h W2^T times the routing weight (`gammas`) rounded to bf16 per pair, then the k pairs of
     each token summed in fp32 in slot order (the library's grouped reduction over `ScatterIndx`)
     and cast to bf16. Only this rounding differs from the reference, which rounds y before the
     fp32 weight multiplies it: within one bf16 ulp per pair.
Invariants:
- The API generation vLLM vendors (`vllm/third_party/triton_kernels`, triton v3.5.x: `matmul_ogs`,
  `routing.compute_expt_data`, `FusedActivation.reduction_n`); later ones (`SparseMatrix`, `matmul`)
  are refused, as is PyPI's unrelated `triton-kernels` package. Opt-in (`DELTASERVE_TRITON_KERNELS=1`)
  while the converted copy sits beside the packed experts our kernels and the reference read.
- Weights are converted once (`prepare`, at load): our packed [E, O, I/2] codes (low nibble first)
  and [E, O, I/32] e8m0 scales are viewed K-major as the library's [E, I, O] FP4 tensor (its
  `W_TRANSPOSE` form: codes packed along K, low nibble the earlier k, as `tl.dot_scaled` reads them)
  and [E, I/32, O] scales, then swizzled for the GPU (`make_default_matmul_mxfp4_w*_layout`).
- Routing metadata is built on the device from our router's ids with no host read: a stable sort
  by expert, int32 counts, and `compute_expt_data`; slot order is kept (no per-token re-sort).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
import weakref

import torch
import triton
import triton.language as tl

from ... import env
from ...ops.operands import ExpertWeights, GluAct
from ..triton.moe import situ

WIDTH_MULTIPLE = 128  # D and I (conservative: TMA rows, Hopper's scale swizzle without K padding)


@triton.jit
def _deltaserve_situ(acc, situ_beta, situ_linear_beta):
    """SiTU over interleaved (gate, up) columns of the fp32 accumulator [M, 2n] -> [M, n]."""
    g, u = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    return situ(g, u, situ_beta, situ_linear_beta, situ_linear_beta is not None)


@triton.jit
def _deltaserve_silu(acc):
    """SwiGLU over interleaved (gate, up) columns: bf16(silu(g)) * u, as torch computes it in bf16."""
    g, u = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    return (g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32) * u


@functools.cache
def _lib():
    """The library's entry points, or None where it does not import, is another API generation, or
    is disabled (any import error: it touches the GPU driver)."""
    if not env.TRITON_KERNELS.on():
        return None
    try:
        mm, routing, tensor, layout, flags = (
            importlib.import_module(f"triton_kernels.{name}")
            for name in ("matmul_ogs", "routing", "tensor", "tensor_details.layout", "matmul_ogs_details.opt_flags")
        )
        if "reduction_n" not in {f.name for f in dataclasses.fields(mm.FusedActivation)}:
            return None
        return types.SimpleNamespace(
            **{n: getattr(mm, n) for n in ("matmul_ogs", "PrecisionConfig", "FusedActivation", "FnSpecs")},
            **{n: getattr(routing, n) for n in ("RoutingData", "GatherIndx", "ScatterIndx", "compute_expt_data")},
            **{n: getattr(tensor, n) for n in ("FP4", "wrap_torch_tensor", "convert_layout")},
            layout=layout,
            constrain=flags.update_opt_flags_constraints,
        )
    except Exception:  # noqa: BLE001 - an optional accelerator must never break the engine
        return None


def available() -> bool:
    """Whether `triton_kernels` imports with the `matmul_ogs` API used here (and is not disabled)."""
    return _lib() is not None


def _widths_ok(ex: ExpertWeights) -> bool:
    (w1, s1), (w3, s3), (w2, s2) = ex.operands()
    num, inter, d = w1.shape[0], w1.shape[1], 2 * w1.shape[2]
    if d % WIDTH_MULTIPLE or inter % WIDTH_MULTIPLE or w3.shape != w1.shape or s3.shape != s1.shape:
        return False
    return s1.shape == (num, inter, d // 32) and (w2.shape, s2.shape) == ((num, d, inter // 2), (num, d, inter // 32))


def weights_fit(ex: ExpertWeights, act: GluAct) -> bool:
    """Whether `prepare` applies (what load time knows): packed MXFP4 experts computed in bf16 on
    one CUDA device, D and I multiples of 128, SiTU or SwiGLU, and the library available."""
    if not (ex.packed and ex.dtype == torch.bfloat16 and act.kind in ("situ", "silu")):
        return False
    tensors = [t for pair in ex.operands() for t in pair]
    return all(t.is_cuda and t.device == tensors[0].device for t in tensors) and _widths_ok(ex) and available()


def fits(x: torch.Tensor, ex: ExpertWeights, act: GluAct) -> bool:
    """Whether the library runs packed experts on x: bf16 [N, D] on their device, SiTU or SwiGLU.
    The weights' own conditions (`weights_fit`) are not checked again: ask only for experts that
    `prepared_for` finds prepared (`prepare` ran where they held). Runs on every MoE call."""
    on_device = x.is_cuda and ex.packed and x.device == ex.w1[0].device
    return on_device and x.dtype == torch.bfloat16 and x.dim() == 2 and act.kind in ("situ", "silu")


@dataclasses.dataclass
class Prepared:
    """The experts in the library's layout: W13 [E, D, 2I] (interleaved), W2 [E, I, D], with their
    precision configs (the e8m0 scales); `refs` identify the packed tensors they were made from."""

    w13: object
    pc13: object
    w2: object
    pc2: object
    num: int
    refs: tuple


def _to_lib(lib, packed: torch.Tensor, scale: torch.Tensor):
    """Our [E, O, I/2] codes and [E, O, I/32] scales as the library's [E, I, O] FP4 weight (a K-major
    view: no copy on the strided layout) and its PrecisionConfig."""
    w = lib.wrap_torch_tensor(packed.transpose(-1, -2), dtype=lib.FP4)
    s = lib.wrap_torch_tensor(scale.transpose(-1, -2))
    if packed.is_cuda:  # the library's swizzle for this GPU (vLLM's `_swizzle_mxfp4`)
        value_layout, value_opts = lib.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = lib.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
        w, s = lib.convert_layout(w, value_layout, **value_opts), lib.convert_layout(s, scale_layout, **scale_opts)
    return w, lib.PrecisionConfig(weight_scale=s)


_CACHE: dict[int, Prepared] = {}


def prepare(ex: ExpertWeights) -> Prepared:
    """Convert packed experts (at load: `prepare_moe`; again after the weights change, as every
    plan) and remember the result for `prepared_for` while the packed tensors live. W13 is a copy
    (W2 too where swizzled): as much memory as the originals."""
    lib = _lib()
    tensors = tuple(t for pair in ex.operands() for t in pair)
    (w1, s1), (w3, s3), (w2, s2) = ex.operands()
    major = torch.cuda.get_device_capability(w1.device)[0] if w1.is_cuda else 0
    if major >= 9:  # vLLM's constraints for these layouts: no split-k on Hopper, persistent on Blackwell
        lib.constrain({"split_k": 1} if major == 9 else {"is_persistent": True, "epilogue_subtile": 1})
    w13, pc13 = _to_lib(lib, torch.stack((w1, w3), 2).flatten(1, 2), torch.stack((s1, s3), 2).flatten(1, 2))
    w2l, pc2 = _to_lib(lib, w2, s2)
    key = id(tensors[0])
    prepared = Prepared(w13, pc13, w2l, pc2, w1.shape[0], tuple(weakref.ref(t) for t in tensors))
    _CACHE[key] = prepared
    weakref.finalize(tensors[0], _CACHE.pop, key, None)
    return prepared


def prepared_for(ex: ExpertWeights) -> Prepared | None:
    """What `prepare` made from exactly these packed tensors, or None (at once when nothing was
    prepared: the default, opt-out case on every MoE call)."""
    if not _CACHE or not ex.packed:
        return None
    tensors = tuple(t for pair in ex.operands() for t in pair)
    hit = _CACHE.get(id(tensors[0]))
    return hit if hit is not None and all(r() is t for r, t in zip(hit.refs, tensors)) else None


def routing(ids: torch.Tensor, weights: torch.Tensor, num: int):
    """(RoutingData, GatherIndx, ScatterIndx) of our router's ids / weights [N, k], on the device:
    pairs (token * k + slot) stably sorted by expert; gather src = the sorted pairs, dst = each
    pair's sorted position (scatter: the reverse); gate_scal = the fp32 weights in sorted order."""
    lib = _lib()
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    hist = torch.zeros(num, dtype=torch.int32, device=ids.device)
    hist.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.int32, device=ids.device))  # no bincount read-back
    data = lib.RoutingData(weights.reshape(-1).float()[order], hist, num, k, lib.compute_expt_data(hist, num, n * k))
    src, dst = order.to(torch.int32), rank.to(torch.int32)
    return data, lib.GatherIndx(src_indx=src, dst_indx=dst), lib.ScatterIndx(src_indx=dst, dst_indx=src)


def activation(act: GluAct):
    """Our GLU activation as the library's fused activation over interleaved (gate, up) columns."""
    lib = _lib()
    if act.kind == "situ":
        specs = lib.FnSpecs("deltaserve_situ", _deltaserve_situ, ("situ_beta", "situ_linear_beta"))
        linear_beta = None if act.linear_beta is None else float(act.linear_beta)
        return lib.FusedActivation(specs, (float(act.beta), linear_beta), 2)
    return lib.FusedActivation(lib.FnSpecs("deltaserve_silu", _deltaserve_silu, ()), (), 2)


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, prepared: Prepared, act: GluAct):
    """`grouped_experts` on the library: x [N, D] bf16, ids / weights [N, k] -> [N, D] bf16 (see the
    module docstring for the one rounding that differs). Caller checked `fits`."""
    n, k = ids.shape
    if n == 0 or k == 0:
        return x.new_zeros(n, x.shape[1])
    lib = _lib()
    data, gather, scatter = routing(ids, weights, prepared.num)
    h = lib.matmul_ogs(
        x.contiguous(), prepared.w13, None, data, gather_indx=gather, precision_config=prepared.pc13,
        fused_activation=activation(act),
    )  # fmt: skip
    return lib.matmul_ogs(
        h, prepared.w2, None, data, scatter_indx=scatter, precision_config=prepared.pc2, gammas=data.gate_scal
    )
