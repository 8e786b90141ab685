"""`SpecDecoder`: drafts for the scheduler, one verify forward per step, the fold of what was verified.

Drafts come from a `Proposer` (proposer.py): before each step's scheduling, `prepare` asks it
once, batched, for every running decoding sequence that may draft (its adaptive k > 0), and the
scheduler's per-sequence `propose` then takes them (cut to its token budget); a sequence that
left the running set since (preempted, aborted) is `release`d by the proposer.

A step with drafts is a verify step. Every decoding sequence of it that may speculate (no grammar,
reasoning budget or logprobs: `eligible`) is a verify sequence, drafts or none, so zero-draft
sequences take the drafted ones' state path: its token and drafts ride as a short prefill-like
extension (MLA over the new positions, KDA chunked over them from the live state), the forward
pass leaves its live KDA slot at the pre-verify state, and after the engine has appended the
verified tokens (`verify.py` picks them; a stop may cut them short) exactly those are folded into
the slot (`ModelRunner.fold`: the recurrence re-run over the kept per-token inputs). MLA rows
written past the verified tokens are never read (contexts end at `num_computed`) and are
overwritten by the next step; prefix units and checkpoints are registered by the engine's
commit after the fold, from verified tokens only. A step without drafts is an ordinary step.

Draft lengths keep a verify step inside one prefix match unit (a fully accepted step ends at most
on the unit's boundary, where the engine's commit checkpoints as without speculation), inside
`max_model_len` and inside the request's `max_tokens`."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import weakref

import torch

from ...kernels.cpu.abi import MAX_ROWS
from ..exec.runner import ModelRunner
from ..exec.sampler import Sampler, SamplingRow
from ..request.sequence import Sequence
from ..sched.scheduler import ScheduledSeq
from .adaptive import AdaptiveK, SpecMetrics
from .config import SpecConfig
from .drafters import NgramDrafter, SuffixDrafter
from .proposer import DraftRequest, ModelFreeProposer, Proposer
from .verify import accept_greedy, accept_sampled


def model_free(config: SpecConfig) -> Proposer:
    """The proposer of a model-free method (ngram, suffix)."""
    if config.method == "ngram":
        return ModelFreeProposer(NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max))
    return ModelFreeProposer(
        SuffixDrafter(config.suffix_max_depth, config.suffix_min_prob, config.suffix_cache_requests)
    )


BIT_IDENTICAL_ROWS = MAX_ROWS  # rows a native bf16 whole-stack call rounds as one-row calls do (GEMV kernels)


def step_row_cap(model) -> int | None:
    """Rows (decodes + drafts) a speculative step may feed: on the native bf16 whole-stack path,
    `BIT_IDENTICAL_ROWS`, so a verify rounds as plain decode steps do and greedy tokens equal
    spec-off's (more rows take the tile kernels, which round otherwise); None elsewhere."""
    stack = getattr(getattr(model, "model", None), "prepared", None)
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    return BIT_IDENTICAL_ROWS if stack is not None and bf16 else None


@dataclasses.dataclass
class Speculating:
    """A decoding sequence's speculation state: its draft length control and its shadow probes out
    ((first position, drafts) each)."""

    control: AdaptiveK
    shadow: list[tuple[int, list[int]]]


class SpecDecoder:
    def __init__(
        self, config: SpecConfig, max_model_len: int, unit: int | None = None, proposer: Proposer | None = None
    ):
        """`unit`: the prefix match unit when prefix caching is on (verify steps stay inside one).
        `proposer`: the draft source (default: the model-free one of `config.method`)."""
        self.config, self.max_model_len, self.unit = config, max_model_len, unit
        self.proposer = proposer if proposer is not None else model_free(config)
        self.metrics = SpecMetrics(config.num_speculative_tokens)
        self._seqs: weakref.WeakKeyDictionary[Sequence, Speculating] = weakref.WeakKeyDictionary()
        self._pending = None  # (batch, verify flags, accepted counts) between execute and settle
        self._drafts: dict[Sequence, list[int]] = {}  # this step's proposals, taken by `propose`
        self._hidden: weakref.WeakKeyDictionary[Sequence, torch.Tensor] = weakref.WeakKeyDictionary()
        self._decoding: set[Sequence] = set()  # sequences the proposer was asked for (left at release or finish)
        self.probes = 0  # shadow probes scored

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        return p.structured is None and p.thinking_token_budget is None and p.logprobs is None and not seq.prefill_only

    def _room(self, seq: Sequence) -> int:
        """Most drafts `seq` may take now (the limits in the module docstring)."""
        room = self.max_model_len - 1 - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_ids) - 1)
        if self.unit:
            room = min(room, (seq.num_computed // self.unit + 1) * self.unit - seq.num_computed - 1)
        return room

    def _state(self, seq: Sequence) -> Speculating:
        state = self._seqs.get(seq)
        if state is None:
            c = self.config
            drafting = getattr(self.proposer, "draft_cost", 0.0)
            control = AdaptiveK(
                c.num_speculative_tokens,
                c.draft_cost + drafting,
                c.probe_interval,
                c.adaptive,
                c.step_cost,
                c.rollback_cost,
                free=drafting == 0,
            )
            state = self._seqs[seq] = Speculating(control, [])
        return state

    def prepare(self, runner: ModelRunner, running: list[Sequence], max_step_rows: int | None = None) -> None:
        """Before scheduling: release the sequences that stopped running since the last step
        without finishing (preempted, aborted: an abort is released here, at the next step), then
        ask the proposer once for the drafts of every running decoding sequence whose k is
        positive now, and for the shadow probes due (adaptive.py), which are only scored. Under
        `max_step_rows` (the scheduler's cap on a step's rows) only as many drafts (a probe counting
        one) as the rows the running sequences leave: none while they fill it."""
        taps = runner.keep_hidden = self.proposer.wants_hidden
        if self._decoding:
            for seq in self._decoding.difference(running):  # preempted or aborted (`finished` left)
                self._decoding.discard(seq)
                self._hidden.pop(seq, None)
                self.proposer.release(seq)
        spare = sys.maxsize if max_step_rows is None else max_step_rows - len(running)
        requests, probes = [], []
        for seq in running:
            if spare < 1:  # no row left for a draft: nothing more to ask for (probes wait as well)
                break
            if seq.num_pending != 1 or not self.eligible(seq):
                continue
            state = self._state(seq)
            control = state.control
            if state.shadow:
                self._score_probes(seq, control, state.shadow)
            k = control.next_k()
            if k:  # cut to the room left (0: none, and no probe either)
                cut = min(k, self._room(seq), spare)
                k = cut if cut == k or not control.adaptive or control.rate(cut) > 1.0 else 0  # a cut k must pay
                if k > 0:
                    requests.append(DraftRequest(seq, k, self._hidden.pop(seq, None) if taps else None))
                    spare -= k
            elif control.probe_due and self._room(seq) > 0:
                probes.append(DraftRequest(seq, control.probe_k, self._hidden.pop(seq, None) if taps else None))
                spare -= 1  # a probe stands for the row a draft of it would take
        if not (requests or probes):
            self._drafts = {}
            return
        asked = requests + probes
        proposals = self.proposer.propose(asked)
        self._decoding.update(r.seq for r in asked)
        self._drafts = {r.seq: d[: r.k] for r, d in zip(requests, proposals)}
        for r, d in zip(probes, proposals[len(requests) :]):
            state = self._seqs[r.seq]
            if d:
                state.shadow.append((r.seq.num_tokens, list(d[: r.k])))
            state.control.probe_taken(bool(d))  # none: nothing repeats, the interval doubles

    def _score_probes(self, seq: Sequence, control: AdaptiveK, shadow: list) -> None:
        """Score each shadow probe that decoded tokens decide as a greedy verify step: its leading
        drafts equal to the tokens decoded at their positions are accepted."""
        for probe in list(shadow):
            start, drafts = probe
            have = seq.token_slice(start, min(seq.num_tokens, start + len(drafts)))
            m = 0
            while m < len(have) and have[m] == drafts[m]:
                m += 1
            if m < len(have) or m == len(drafts):
                shadow.remove(probe)
                self.probes += 1
                control.probe_scored(len(drafts), m)

    def propose(self, seq: Sequence, most: int) -> list[int]:
        """The scheduler's drafter: this step's proposal for a decoding sequence, at most `most`."""
        return self._drafts.pop(seq, [])[:most] if self._drafts else []

    def execute(
        self, runner: ModelRunner, scheduled: list[ScheduledSeq], rows: list[SamplingRow | None]
    ) -> tuple[list[list[int]], list[list]]:
        """Run a verify step: per scheduled sequence the tokens to append (empty where `rows[i]` is
        None) and their logprobs. `fold` must follow once the engine appended them."""
        verify = [
            r is not None and s.num_new == 1 and s.seq.num_pending == 1 and self.eligible(s.seq)
            for s, r in zip(scheduled, rows)
        ]
        ends = list(itertools.accumulate(s.width for s in scheduled))
        logit_rows: list[int] = []
        for s, r, v, end in zip(scheduled, rows, verify, ends):
            if r is not None:
                logit_rows.extend(range(end - s.width, end) if v else [end - 1])
        logits, batch = runner.verify_logits(scheduled, logit_rows, verify)
        tokens: list[list[int]] = [[] for _ in scheduled]
        logprobs: list[list] = [[] for _ in scheduled]
        self._sample_plain(runner, logits, scheduled, rows, verify, tokens, logprobs)
        accepted = self._verify(runner, logits, scheduled, rows, verify, tokens, logprobs)
        self._pending = (batch, verify, accepted)
        return tokens, logprobs

    @staticmethod
    def _positions(scheduled, rows, verify) -> list[list[int]]:
        """Per scheduled sequence, its rows of the logits (in `logit_rows` order)."""
        out, at = [], 0
        for s, r, v in zip(scheduled, rows, verify):
            n = 0 if r is None else s.width if v else 1
            out.append(list(range(at, at + n)))
            at += n
        return out

    def _sample_plain(self, runner, logits, scheduled, rows, verify, tokens, logprobs) -> None:
        """Completing sequences that do not verify (a prefill's first token, ineligible decodes):
        the ordinary sampler, as in a step without drafts."""
        pos = self._positions(scheduled, rows, verify)
        plain = [i for i, (r, v) in enumerate(zip(rows, verify)) if r is not None and not v]
        if not plain:
            return
        idx = torch.tensor([pos[i][0] for i in plain], device=logits.device)
        out = runner.sample(logits.index_select(0, idx), [rows[i] for i in plain])
        for i, t, lp in zip(plain, out.token_ids, out.logprobs):
            tokens[i], logprobs[i] = [t], [lp]

    def _verify(self, runner, logits, scheduled, rows, verify, tokens, logprobs) -> list[int]:
        """Accept or reject each verify sequence's drafts; returns the accepted counts."""
        pos = self._positions(scheduled, rows, verify)
        mine = [i for i, v in enumerate(verify) if v]
        vrows = [r for i in mine for r in self._rows_at(rows[i], scheduled[i])]
        picked = [p for i in mine for p in pos[i]]
        if picked != list(range(logits.shape[0])):  # else every row, in order: no gather
            logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
        x = Sampler.penalized_logits(logits, vrows)
        ops = getattr(runner.model, "ops", None)
        choices = (ops.argmax_rows(x) if ops is not None else x.argmax(dim=-1)).tolist()
        accepted, at = [], 0
        for i in mine:
            s, w = scheduled[i], scheduled[i].width
            if s.seq.params.greedy:
                out = accept_greedy(choices[at : at + w], s.drafts)
            else:
                probs = Sampler.sampling_probs(x[at : at + w], [s.seq.params] * w)
                out = accept_sampled(probs, s.drafts, rows[i].generator)
            at += w
            tokens[i], logprobs[i] = out, [None] * len(out)
            accepted.append(len(out) - 1)
            self.metrics.observe(len(s.drafts), len(out) - 1)
            state = self._seqs.get(s.seq)
            if state is not None:
                state.control.observe(len(s.drafts), len(out) - 1)
        return accepted

    @staticmethod
    def _rows_at(row: SamplingRow, s: ScheduledSeq) -> list[SamplingRow]:
        """`row` at each of `s`'s verified positions: its outputs grown by the drafts before it where
        penalties or a min_tokens ban read them, else `row` itself (no per-position copy)."""
        if not Sampler.reads_outputs(s.seq.params, len(s.seq.output_ids)):
            return [row] * s.width
        out = list(s.seq.output_ids)
        return [dataclasses.replace(row, output_ids=out + list(s.drafts[:j])) for j in range(s.width)]

    def settle(self, runner: ModelRunner, scheduled: list[ScheduledSeq], rows: list, appended: list[int]) -> None:
        """After the engine appended a step's tokens: fold, per verify sequence, the tokens now
        verified (`appended[i]` of scheduled sequence i: the fed tokens they follow), and keep the
        target's hidden rows of those positions for a proposer that taps them."""
        verify = [False] * len(scheduled)
        if self._pending is not None:
            batch, verify, _ = self._pending
            self._pending = None
            runner.fold(batch, [m for m, v in zip(appended, verify) if v])
        if runner.hidden is None:
            return
        for s, pos, m in zip(scheduled, self._positions(scheduled, rows, verify), appended):
            if m:
                self._hidden[s.seq] = runner.hidden[pos[0] : pos[0] + m]
        runner.hidden = None

    def finished(self, seq: Sequence) -> None:
        """A sequence finished: its proposer state goes (into the session store, for suffix)."""
        self._decoding.discard(seq)
        self._seqs.pop(seq, None)
        self.proposer.finished(seq)

    def stats(self) -> dict:
        return {**self.metrics.stats(), "shadow_probes": self.probes, **self.proposer.stats()}
