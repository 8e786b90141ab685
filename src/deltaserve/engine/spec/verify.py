"""Which drafted tokens a verify step keeps: exact at temperature 0, distribution-preserving above.

For one sequence with drafts d_1..d_k, `probs[j]` / `choices[j]` is the target's distribution /
greedy token for the position after d_1..d_j (row 0: after the sequence's own last token). The
result is the accepted drafts plus one token from the target: its correction at the first
rejection, else a bonus token from row k; so a step yields between 1 and k + 1 tokens.

- Greedy: d_j is kept iff it equals the target's greedy choice there, so the output is the
  target's greedy output token for token.
- Sampled: drafts are point masses (deterministic drafters), so d_j is kept with probability
  p_j(d_j), else the token is drawn from the residual (p_j - onehot(d_j))+ renormalised, i.e.
  p_j with d_j removed. Each emitted token is then distributed exactly as p_j: p(d) * [x = d]
  + (1 - p(d)) * p(x) [x != d] / (1 - p(d)) = p(x). Uniforms and the exponential race that samples
  a distribution (the sampler's Gumbel-max form, V draws) come from the sequence's own generator,
  so a seeded request repeats its output."""

from __future__ import annotations

import torch

from ..exec.sampler import exp_noise


def accept_greedy(choices: list[int], drafts: tuple[int, ...] | list[int]) -> list[int]:
    """Accepted drafts + the target's next token; `choices` has len(drafts) + 1 entries."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        out.append(choices[j])
        if choices[j] != d:
            return out
    out.append(choices[len(drafts)])
    return out


def residual(p: torch.Tensor, d: int) -> torch.Tensor:
    """(p - onehot(d))+ renormalised: `p` with `d` removed (zeros if p is a point mass on d)."""
    r = p.clone()
    r[d] = 0.0
    total = r.sum()
    return r / total if float(total) > 0 else r


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token ~ p: argmax(p / q), q ~ Exp(1) per entry (the exponential race)."""
    q = exp_noise((1, p.shape[-1]), [generator], "cpu")[0]
    return int(torch.argmax(p.float().cpu() / q))


def accept_sampled(
    probs: torch.Tensor, drafts: tuple[int, ...] | list[int], generator: torch.Generator | None
) -> list[int]:
    """Rejection sampling of point-mass drafts against `probs` [len(drafts) + 1, V]."""
    p = probs.float().cpu()
    out: list[int] = []
    for j, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator))
        if u < float(p[j, d]):
            out.append(d)
            continue
        out.append(sample(residual(p[j], d), generator))
        return out
    out.append(sample(p[len(drafts)], generator))
    return out
