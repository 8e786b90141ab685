"""Block Attention Residuals mix (spec/model.md §5)."""
from __future__ import annotations

import torch


def attn_res_mix(cur: torch.Tensor, bank: list[torch.Tensor], proj: torch.Tensor,
                 norm: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Softmax over depth of `[*bank, cur]` (cur LAST). cur and bank entries: [N, D];
    proj, norm: [D] (a checkpoint's [1, D] proj flattened). Scores are
    `rmsnorm_weightless(X) . (norm * proj)` in fp32 with no 1/sqrt(D); the RAW X are mixed in
    fp32 and the result is cast to cur's dtype."""
    x = torch.stack([*bank, cur]).float()                           # [S, N, D], cur last
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    scores = xn @ (norm.float() * proj.float())                      # [S, N]
    a = torch.softmax(scores, dim=0)
    return (a.unsqueeze(-1) * x).sum(0).to(cur.dtype)
