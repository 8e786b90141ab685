"""flash-linear-attention's KDA prefill (`fla.ops.kda.chunk_kda`, from `fla-core`), imported lazily.

Used only where it fits: CUDA tensors, half-precision models (fp32 ones keep our exact-fp32
kernel), no export offsets (fla cannot export states inside the pass), and not disabled with
`DELTASERVE_FLA=0`. Never required: without fla-core our kernel runs.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ... import env
from ...kernels.transfer import host_copy
from ..triton import optional_import


@functools.cache
def _chunk_kda():
    return optional_import("fla.ops.kda", "chunk_kda", env.FLA)


@functools.cache
def _takes_host_cu() -> bool:
    """Whether this fla's `chunk_kda` accepts `cu_seqlens_cpu` (newer releases): it then plans
    from our host copy instead of reading `cu_seqlens` back from the GPU."""
    fn = _chunk_kda()
    try:
        return fn is not None and "cu_seqlens_cpu" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no introspectable signature: call it the old way
        return False


def available() -> bool:
    """Whether fla-core's KDA prefill imports (and is not disabled)."""
    return _chunk_kda() is not None


def fits(q: torch.Tensor, dtype: torch.dtype, export_offsets) -> bool:
    """Whether fla runs this prefill: CUDA tensors, a half-precision model `dtype`, no exports."""
    no_exports = export_offsets is None or not any(export_offsets)
    return q.is_cuda and dtype in (torch.bfloat16, torch.float16) and no_exports and available()


def chunk_kda(q, k, v, g, beta, cu_seqlens, scale, initial_state=None, dtype=torch.bfloat16):
    """`ops.kda.kda_chunked` contract (without exports) on fla's kernel: q, k (L2-normalised), v
    cast to `dtype`; g, beta fp32. Returns (o fp32 [N, H, V], final state fp32 [B, H, K, V])."""
    n, h, dk = k.shape
    nseq = cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = torch.zeros(nseq, h, dk, v.shape[-1], device=q.device, dtype=torch.float32)
    host = {"cu_seqlens_cpu": host_copy(cu_seqlens).to(torch.long)} if _takes_host_cu() else {}
    o, final = _chunk_kda()(
        q.to(dtype).unsqueeze(0),
        k.to(dtype).unsqueeze(0),
        v.to(dtype).unsqueeze(0),
        g.float().unsqueeze(0),
        beta.float().unsqueeze(0),
        scale=scale,
        initial_state=initial_state.float().contiguous(),
        output_final_state=True,
        cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long),
        **host,
    )
    return o.squeeze(0).float(), final.float()
