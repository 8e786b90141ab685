"""The `Proposer` protocol: what a source of draft tokens gives the `SpecDecoder`, and what it gets.

Once per engine step, before scheduling, the decoder hands the proposer every running decoding
sequence that may draft this step as a `DraftRequest` (the sequence and its k, at least 1) in
one `propose` call, and takes back at most k tokens per request (fewer or none: a zero-draft
step for that sequence). The call is batched so a model drafter runs one forward per draft
position for all sequences together; the model-free drafters answer per sequence (an index
lookup each, no batched op exists for them).

Hidden-state taps (an EAGLE / DSpark-style drafter): a proposer whose `wants_hidden` is True
gets, in `DraftRequest.hidden`, the target's final-normed hidden states [n, D] (what the lm_head
reads) of the positions whose outputs were the sequence's last n tokens, n >= 1: row i is
position `seq.num_tokens - 1 - n + i`. These are the rows of the latest step that computed the
sequence (a verify step: its verified positions; a decode step or a prefill's last chunk: its
last position), kept by the runner only when a proposer asks (`ModelRunner.keep_hidden`, which
also turns off the fused decode call that never materialises them). `hidden` is None for a
sequence with no such rows yet (the first request after a preemption or a handoff). Taps of
inner layers would extend `keep_hidden` the same way; no drafter of that kind is built yet.

Cost: `draft_cost` is what the proposer spends per draft token, in target decode steps (a model
drafter's forward; ~0 for an index lookup); the adaptive k (adaptive.py) adds it to the cost of
verifying a draft.

State: a proposer may keep per-sequence state (a draft model's cache); `release(seq)` says the
sequence stopped decoding without finishing (preempted, aborted): its state goes, and a later
request for it rebuilds from `seq`'s tokens. `finished(seq)` says it finished. Drafts must be
deterministic given the sequence's tokens (point masses: `verify.accept_sampled` relies on it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..request.sequence import Sequence


@dataclass
class DraftRequest:
    seq: Sequence
    k: int
    hidden: torch.Tensor | None = None


class Proposer(Protocol):
    wants_hidden: bool
    draft_cost: float

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """At most `r.k` draft tokens after each request's sequence, in order."""
        ...

    def release(self, seq: Sequence) -> None: ...

    def finished(self, seq: Sequence) -> None: ...

    def stats(self) -> dict: ...


class ModelFreeProposer:
    """An n-gram or suffix drafter (drafters.py) behind the protocol."""

    wants_hidden = False
    draft_cost = 0.0

    def __init__(self, drafter):
        self.drafter = drafter

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self.drafter.propose(r.seq, r.k)[: r.k] for r in requests]

    def release(self, seq: Sequence) -> None:
        """Its index stays valid: it depends on the sequence's tokens only, which a preemption keeps."""

    def finished(self, seq: Sequence) -> None:
        self.drafter.finished(seq)

    def stats(self) -> dict:
        return {}
