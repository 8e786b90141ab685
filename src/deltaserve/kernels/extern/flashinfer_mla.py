"""FlashInfer's paged MLA decode (`flashinfer.mla.BatchMLAPagedAttentionWrapper`), imported lazily.

Runs the contract of `triton.mla.mla_decode_attention` over a paged `MlaRowsView` (one query per
sequence over its whole context, no mask beyond the length) on FlashInfer's kernel, chosen by its
"auto" policy (FA3 on Hopper, FA2 on Ampere; newer kernels elsewhere). Used only where it fits:
CUDA tensors, bf16/fp16 query and pool of one dtype (fp32 models keep our exact kernel),
kv_lora_rank 512 with rope width 64 (the widths every FlashInfer release builds), and not
disabled with `DELTASERVE_FLASHINFER=0`. Never required: without flashinfer our kernel runs.

Invariants:
- No copy of the pool: a layer's rows [num_pages * page_size, R + Dr] are viewed as
  [num_pages, page_size, R + Dr]; FlashInfer takes the c_hat / k_rot halves as strided views (its
  kernels read the page and row strides; rows are 16-byte multiples and the halves 16-byte aligned).
- Planned once per step: the plan (scheduling from lengths and page lists) is shared by every layer
  of a step, so it is remade only when `view.batch` (held by weak reference) or the shape changes.
- Plan metadata is int32 host tensors built from `host_copy` (FlashInfer reads the indptrs and
  lengths on the host and sends the page list to the device itself): nothing is read back from
  the GPU. One 128 MiB workspace and one wrapper per device, made on first use.
"""

from __future__ import annotations

import functools
import importlib
import logging
import weakref

import torch

from ... import env
from ...kernels.transfer import host_copy

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace
_WIDTHS = (512, 64)  # (kv_lora_rank, rope width) that every FlashInfer MLA build supports


@functools.cache
def _mla():
    """`flashinfer.mla`, or None where it does not import (any error: it loads CUDA libraries)."""
    if not env.FLASHINFER.on():
        return None
    try:
        mod = importlib.import_module("flashinfer.mla")
    except Exception:  # noqa: BLE001 - an optional accelerator must never break the engine
        return None
    return mod if hasattr(mod, "BatchMLAPagedAttentionWrapper") else None


def available() -> bool:
    """Whether FlashInfer's MLA wrapper imports (and is not disabled)."""
    return _mla() is not None


def _refusal(q_latent: torch.Tensor, rows: torch.Tensor, rank: int, page_size: int) -> str | None:
    """Why FlashInfer cannot take these tensors (device aside), or None."""
    if q_latent.dtype not in (torch.bfloat16, torch.float16) or rows.dtype != q_latent.dtype:
        return "needs a bf16/fp16 query and pool of the same dtype"
    if q_latent.dim() != 3 or rows.dim() != 2 or rows.shape[1] != q_latent.shape[2]:
        return "needs q_latent [B, H, R + Dr] and rows [num_rows, R + Dr]"
    if (rank, q_latent.shape[2] - rank) != _WIDTHS:
        return f"supports (kv_lora_rank, rope width) = {_WIDTHS} only"
    if page_size < 1 or rows.shape[0] % page_size or not rows.is_contiguous() or rows.data_ptr() % 16:
        return "needs the rows as one contiguous, 16-byte aligned [num_pages * page_size, R + Dr] tensor"
    return None


def fits(q_latent: torch.Tensor, rows: torch.Tensor, rank: int, page_size: int) -> bool:
    """Whether FlashInfer runs this paged decode: CUDA tensors on one device, supported layout."""
    on_gpu = q_latent.is_cuda and rows.device == q_latent.device
    return on_gpu and _refusal(q_latent, rows, rank, page_size) is None and available()


def _plan_args(view) -> dict[str, torch.Tensor]:
    """FlashInfer's CSR plan metadata for `view` (int32, host): qo_indptr = arange(B + 1), kv_indptr
    from the page counts ceil(c_b / page_size), kv_indices = those leading pages of each row of the
    block table, kv_len_arr = c_b. Built from host copies only."""
    cu = host_copy(view.cu_kv).to(torch.long)
    lens = cu[1:] - cu[:-1]
    pages = (lens + view.page_size - 1) // view.page_size
    table = host_copy(view.block_table)
    used = torch.arange(table.shape[1]) < pages[:, None]
    i32 = torch.int32
    return {
        "qo_indptr": torch.arange(lens.numel() + 1, dtype=i32),
        "kv_indptr": torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(i32),
        "kv_indices": table[used].to(i32).contiguous(),
        "kv_len_arr": lens.to(i32),
    }


class _Device:
    """A device's workspace, wrapper and the step and shape it was last planned for (`planned`: False
    where FlashInfer refused that plan, so the step's layers use our kernel without asking again)."""

    def __init__(self, device: torch.device):
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = _mla().BatchMLAPagedAttentionWrapper(workspace, backend="auto")
        self.batch, self.shape, self.planned = None, None, False


@functools.cache
def _refused_plan(reason: str) -> None:
    """Log each distinct refusal once."""
    logging.getLogger(__name__).warning("FlashInfer refused an MLA decode plan (%s); using ours", reason)


@functools.cache
def _device(device: torch.device) -> _Device:
    return _Device(device)


def _plan(wrapper, meta: dict[str, torch.Tensor], heads: int, rank: int, rope: int, page_size: int, scale, dtype):
    """One `plan` call: the `MLAPlanMetadata` form where this FlashInfer has it, else the flat one."""
    mla = _mla()
    common = dict(num_heads=heads, head_dim_ckv=rank, head_dim_kpe=rope, page_size=page_size, causal=False)
    common.update(sm_scale=float(scale), q_data_type=dtype, kv_data_type=dtype)
    if hasattr(mla, "MLAPlanMetadata"):  # packed query / KV layouts by default
        wrapper.plan(metadata=mla.MLAPlanMetadata.csr(**meta), **common)
    else:  # older releases: flat CSR metadata, split query / KV tensors
        wrapper.plan(**meta, **common)


def _run(wrapper, q: torch.Tensor, pages: torch.Tensor, rank: int) -> torch.Tensor:
    """One `run` call on the planned wrapper: q [B, H, R + Dr], pages [num_pages, page_size, R + Dr]."""
    if hasattr(_mla(), "MLAPlanMetadata"):
        return wrapper.run(query=q, kv_cache=pages)
    return wrapper.run(
        q_nope=q[..., :rank], q_pe=q[..., rank:], ckv_cache=pages[..., :rank], kpe_cache=pages[..., rank:]
    )


def decode(q_latent: torch.Tensor, view, rank: int, scale: float) -> torch.Tensor | None:
    """Latent outputs [B, H, R] in q_latent's dtype of one query per sequence over its context in
    the pool (`view`: an `MlaRowsView` with a block table), or None where FlashInfer refuses to plan
    the step (logged once; the caller runs its own kernel). Caller checked `fits`."""
    b, heads, dk = q_latent.shape
    state = _device(q_latent.device)
    shape = (b, heads, dk, rank, view.page_size, float(scale), q_latent.dtype)
    if state.batch is None or state.batch() is not view.batch or state.shape != shape:
        meta = _plan_args(view)
        if q_latent.is_cuda:  # FlashInfer sends the page list to the GPU: from pinned memory, no stall
            meta["kv_indices"] = meta["kv_indices"].pin_memory()
        state.batch, state.shape = weakref.ref(view.batch), shape
        try:
            _plan(state.wrapper, meta, heads, rank, dk - rank, view.page_size, scale, q_latent.dtype)
            state.planned = True
        except (ValueError, RuntimeError) as err:  # e.g. more work items than its planner takes
            state.planned = False
            _refused_plan(str(err))
    if not state.planned:
        return None
    pages = view.rows.view(-1, view.page_size, dk)
    return _run(state.wrapper, q_latent.contiguous(), pages, rank)
