"""Per-request draft length from a running acceptance estimate, and the engine's spec counters.

A request's per-token acceptance a is estimated from its verify steps with drafts: a step with k
drafts of which m were accepted tested min(m + 1, k) positions and passed m (a geometric trial),
both sums decayed by `DECAY` per step, with a prior of one pass in two tests. The expected tokens
of a step with k drafts are (1 - a^(k+1)) / (1 - a) at a cost of 1 + c k decode steps; k is the
argmax of their ratio over [0, k_max]. k = 0 turns drafting off for the request; every
`probe_interval`-th decode step it drafts one token anyway, so a request whose text turns
repetitive later gets drafting back."""

from __future__ import annotations

DECAY = 0.95
PRIOR_PASS, PRIOR_TESTS = 1.0, 2.0


class AdaptiveK:
    def __init__(self, k_max: int, cost: float, probe_interval: int, adaptive: bool = True):
        self.k_max, self.cost, self.probe_interval, self.adaptive = k_max, cost, probe_interval, adaptive
        self.passed, self.tested = 0.0, 0.0
        self.idle = 0  # decode steps since drafting was last allowed

    @property
    def acceptance(self) -> float:
        return (self.passed + PRIOR_PASS) / (self.tested + PRIOR_TESTS)

    def best_k(self) -> int:
        """The k in [0, k_max] with the most expected tokens per unit of step cost."""
        a = min(self.acceptance, 1.0 - 1e-9)
        rates = [(1.0 - a ** (k + 1)) / (1.0 - a) / (1.0 + self.cost * k) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=rates.__getitem__)

    def next_k(self) -> int:
        """Drafts allowed in this decode step (0: off, but for the periodic probe)."""
        if not self.adaptive:
            return self.k_max
        k = self.best_k()
        if k > 0:
            self.idle = 0
            return k
        self.idle += 1
        if self.idle >= self.probe_interval:
            self.idle = 0
            return 1
        return 0

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.passed = DECAY * self.passed + accepted
        self.tested = DECAY * self.tested + min(accepted + 1, drafted)


class SpecMetrics:
    """Counters of verify steps: `drafts` (sequence-steps with at least one draft), `undrafted`
    (verify sequences without one: they take the same state path), `draft_tokens`,
    `accepted_tokens`, per draft position the drafted and accepted counts."""

    def __init__(self, k_max: int):
        self.drafts = self.undrafted = self.draft_tokens = self.accepted_tokens = 0
        self.drafted_at = [0] * k_max
        self.accepted_at = [0] * k_max

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.undrafted += 1
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted

    def stats(self) -> dict:
        """The counters, acceptance rate, acceptance by position and the mean tokens a drafted step
        yields (1 + accepted / drafts, vLLM's mean acceptance length)."""
        return {
            "drafts": self.drafts,
            "undrafted": self.undrafted,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0,
            "drafted_by_position": list(self.drafted_at),
            "accepted_by_position": list(self.accepted_at),
        }
