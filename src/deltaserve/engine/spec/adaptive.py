"""Per-request draft length from a running acceptance estimate, and the engine's spec counters.

A request's per-token acceptance a is estimated from its verify steps with drafts: a step with k
drafts of which m were accepted tested min(m + 1, k) positions and passed m (a geometric trial),
both sums decayed by `DECAY` per step, with a prior of one pass in two tests. A step with k >= 1
drafts yields (1 - a^(k+1)) / (1 - a) tokens in expectation and costs, in decode steps,

    1 + step + k * per_token + rollback * (1 - a^k)

(`step`: a drafted step's fixed extra work; `per_token`: verifying one more draft plus what the
proposer spends on it, a draft model's forward; `rollback`: undoing rejected drafts, paid when any
is rejected); a step without drafts yields 1 token at cost 1. k is the argmax of tokens per cost
over [0, k_max] (ties: the smaller k), so a request whose acceptance does not pay for a drafted step falls
to k = 0: drafting off for it. Then (and from its first decode step) it probes in the shadow: the
decoder asks the proposer for drafts (`PROBE_DRAFTS` at most) without verifying them and, once the
tokens they guessed are decoded, scores them as a verify step would (greedy acceptance) -- a probe
costs a proposer call, never a verify step. A probe that came true in full, or after which drafting
pays, sets `interval`, the decode steps to the next probe, to `probe_interval`; any other (or one
the proposer had no drafts for) doubles it (up to `MAX_PROBE_INTERVAL`): a request whose text
turns repetitive later gets drafting back, one whose text never does asks ever less (a draft
model's probe costs its forwards). A proposer whose probes cost nothing but an index lookup
(`free`) probes from an interval of 1 that grows to at most `MAX_FREE_PROBE_INTERVAL`, with any
number of probes out (each scored as its tokens are decoded): a repetitive stretch turns drafting
on within a few tokens, free text pays a lookup every few steps. k drafts that
all came true (a probe's or a verify step's) buy the next decode step a trial of min(2k, k_max)
drafts where the estimate does not pay yet: drafting runs on, growing, while whole proposals keep
coming true, so a copy drafts from its first full hit, not only once the estimate has caught up
(free text rarely guesses that many tokens in a row); never where drafting would not pay even at
acceptance 1 (a drafter near the target's size)."""

from __future__ import annotations

DECAY = 0.95
PRIOR_PASS, PRIOR_TESTS = 1.0, 2.0
MAX_PROBE_INTERVAL = 256
MAX_FREE_PROBE_INTERVAL = 8
PROBE_DRAFTS = 3


class AdaptiveK:
    def __init__(
        self,
        k_max: int,
        cost: float,
        probe_interval: int,
        adaptive: bool = True,
        step_cost: float = 0.0,
        rollback_cost: float = 0.0,
        free: bool = False,
    ):
        """`cost`: per draft token, `step_cost` and `rollback_cost` as the module docstring's cost.
        `free`: probes cost nothing (`probe_interval` is then 1; see the module docstring)."""
        probe_interval = 1 if free else probe_interval
        self.k_max, self.cost, self.probe_interval, self.adaptive = k_max, cost, probe_interval, adaptive
        self.free, self.most = free, MAX_FREE_PROBE_INTERVAL if free else MAX_PROBE_INTERVAL
        self.step_cost, self.rollback_cost = step_cost, rollback_cost
        self.passed, self.tested = 0.0, 0.0
        self.idle = probe_interval - 1  # decode steps since the last probe (a new request probes at once)
        self.interval = probe_interval  # decode steps between probes while k = 0
        self.out = 0  # shadow probes out (each settled by its `probe_scored`)
        self.trial = 0  # drafts of a trial step: the latest scored drafts (a probe's, a verify's) all came true
        self.trials = k_max * (1.0 - cost) > step_cost  # drafting pays at acceptance 1 (k_max + 1 tokens)
        self.probe_k = min(k_max, PROBE_DRAFTS)  # drafts a shadow probe asks for
        self.best = self.best_k()

    @property
    def acceptance(self) -> float:
        return (self.passed + PRIOR_PASS) / (self.tested + PRIOR_TESTS)

    def rate(self, k: int) -> float:
        """Expected tokens per unit of step cost with k drafts."""
        if k == 0:
            return 1.0
        a = min(self.acceptance, 1.0 - 1e-9)
        cost = 1.0 + self.step_cost + self.cost * k + self.rollback_cost * (1.0 - a**k)
        return (1.0 - a ** (k + 1)) / (1.0 - a) / cost

    def best_k(self) -> int:
        """The k in [0, k_max] with the most expected tokens per unit of step cost (`rate`'s, the
        powers of a multiplied up as k grows; ties: the smaller k)."""
        a = min(self.acceptance, 1.0 - 1e-9)
        best, most, power = 0, 1.0, 1.0
        for k in range(1, self.k_max + 1):
            power *= a  # a^k
            cost = 1.0 + self.step_cost + self.cost * k + self.rollback_cost * (1.0 - power)
            rate = (1.0 - power * a) / (1.0 - a) / cost
            if rate > most:
                best, most = k, rate
        return best

    def next_k(self) -> int:
        """Drafts to verify in this decode step (0: none; `probe_due` then says whether to probe)."""
        if not self.adaptive:
            return self.k_max
        if self.best > 0 or self.trial > 0:
            self.idle, self.interval = 0, self.probe_interval
            return self.best or self.trial
        if self.free or not self.out:
            self.idle += 1
        return 0

    @property
    def probe_due(self) -> bool:
        """Whether to take a shadow probe now (k = 0, `interval` steps since the last, and none out
        unless probes are free)."""
        ready = self.free or not self.out
        return self.adaptive and self.best == 0 and ready and self.idle >= self.interval

    def probe_taken(self, drafted: bool = True) -> None:
        """A shadow probe was asked for: its drafts are out (`probe_scored` settles it), or the
        proposer had none (nothing repeats: the interval doubles as after a failed probe)."""
        self.idle = 0
        if drafted:
            self.out += 1
        else:
            self.interval = min(2 * self.interval, self.most)

    def probe_scored(self, drafted: int, accepted: int) -> None:
        """A probe's score (as a greedy verify step's): observed, and the next probe's interval set."""
        self.observe(drafted, accepted)
        self.out -= 1
        if accepted == drafted or self.best > 0:
            self.interval = self.probe_interval
        else:
            self.interval = min(2 * self.interval, self.most)
        if not self.free:
            self.idle = 0  # the next probe `interval` steps after this one's score

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.passed = DECAY * self.passed + accepted
        self.tested = DECAY * self.tested + min(accepted + 1, drafted)
        self.trial = min(self.k_max, 2 * drafted) if self.trials and accepted == drafted else 0
        self.best = self.best_k()


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
