"""Block Attention Residuals mix (spec/model.md §5)."""

from __future__ import annotations

import torch

ATTN_RES_EPS = 1e-5


def attn_res_mix(
    cur: torch.Tensor, bank: list[torch.Tensor], proj: torch.Tensor, norm: torch.Tensor, eps: float = ATTN_RES_EPS
) -> torch.Tensor:
    """Softmax over depth of `[*bank, cur]` (cur LAST). cur and bank entries: [N, D];
    proj, norm: [D] (a checkpoint's [1, D] proj flattened). Scores are
    `rmsnorm_weightless(X) . (norm * proj)` in fp32 with no 1/sqrt(D); the RAW X are mixed in
    fp32 and the result is cast to cur's dtype.

    The RMS factor is applied to the dot product (`(X . q) * rsqrt(mean(X^2) + eps)`), which
    equals the normalised-candidate score without materialising the normalised candidates.
    Working set: one fp32 copy of the S = len(bank) + 1 candidates, [S, N, D]. float64 inputs
    are computed in float64."""
    acc = torch.promote_types(cur.dtype, torch.float32)
    x = torch.stack([*bank, cur]).to(acc)  # [S, N, D]
    q = norm.reshape(-1).to(acc) * proj.reshape(-1).to(acc)  # [D]
    rms = torch.rsqrt(x.pow(2).mean(-1) + eps)  # [S, N]
    a = torch.softmax((x @ q) * rms, dim=0)  # [S, N]
    return torch.einsum("sn,snd->nd", a, x).to(cur.dtype)
