"""Reasoning budgets (`SamplingParams.thinking_token_budget`, vLLM's name).

A request whose output starts inside a reasoning section (K3 with thinking on: the prompt ends
with an open think element) names the pieces that close it: `SamplingParams.reasoning_end`, or
the `prefix` of its `structured` output. `ReasoningBudget` follows one sequence:

- reasoning ends naturally at the first control (special) token the sequence generates (K3's
  reasoning never holds one; a structured grammar forbids them before its prefix);
- after `budget` reasoning tokens the engine forces the closing pieces, one sampled token per
  step (every other logit is -inf; the logprobs are still the model's own), so the reasoning is
  at most `budget` tokens and a structured constraint then starts as usual.

Forced tokens are output tokens: they count toward `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .structured import Special, StructuredOutputError


def piece_ids(tokenizer, pieces: Sequence) -> tuple[int, ...]:
    """Token ids of `pieces` (`Special` control tokens by name, `str` encoded as plain text)."""
    out: list[int] = []
    for p in pieces:
        if isinstance(p, Special):
            if p.name not in tokenizer.special_tokens:
                raise StructuredOutputError(f"the tokenizer has no control token {p.name!r}")
            out.append(tokenizer.special_tokens[p.name])
        else:
            out.extend(tokenizer.encode(p))
    return tuple(out)


class ReasoningBudget:
    """One sequence's reasoning: `forced()` is the token it must sample next (None: free)."""

    def __init__(self, budget: int, end_ids: tuple[int, ...], special_ids: frozenset[int]):
        self.budget, self.end_ids, self.special_ids = budget, end_ids, special_ids
        self.used = 0
        self.pos: int | None = 0 if budget == 0 else None  # index into end_ids while forcing
        self.done = False

    def forced(self) -> int | None:
        return None if self.done or self.pos is None else self.end_ids[self.pos]

    def advance(self, token: int) -> None:
        if self.done:
            return
        if self.pos is not None:
            self.pos += 1
            self.done = self.pos == len(self.end_ids)
        elif token in self.special_ids:
            self.done = True
        else:
            self.used += 1
            if self.used >= self.budget:
                self.pos = 0
