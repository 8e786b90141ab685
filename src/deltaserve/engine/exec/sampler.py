"""Batched token sampler.

One step, for logits `[B, V]` and one `SamplingRow` per row, in this order (vLLM v1's):
0. `params.logit_bias` added (token id -> bias);
1. penalties (from a `[B, V]` count tensor built by `scatter_add` over padded id tensors):
   repetition over prompt + output ids (positive logits divided, negative multiplied), then
   frequency (`- f * count`) and presence (`- p * [count > 0]`) over output ids only;
2. `banned_ids` set to -inf while `len(output_ids) < params.min_tokens`; then, for rows with a
   `grammar` (structured outputs), every token the grammar disallows set to -inf (if that
   leaves nothing, the grammar mask alone is applied to the step-1 logits: see
   `structured.apply_bitmask`); rows with a `forced` token (a reasoning budget closing the
   think element, engine/request/reasoning.py) keep that token alone, at logit 0;
3. greedy rows (`params.greedy`): argmax, first index on ties;
4. other rows: divide by temperature; min_p (keep `prob >= min_p * max_prob`); top-k (keep
   logits >= the k-th largest); top-p on the renormalised top-k distribution (keep the
   smallest highest-probability set whose mass >= p). Thresholds are on values, so every token
   tied with the last kept one is kept too. Then the Gumbel-max trick: token =
   argmax(probs / q), q ~ Exp(1), drawn per row from that row's own generator (the global RNG,
   in one batched draw, for rows without one).

Invariants: no Python loop over rows in the arithmetic (the only one draws seeded noise), so a
row's result depends only on its own logits, row and generator state: a seeded row samples the
same token whatever else is in the batch and in whatever order. A seeded row consumes exactly
`V` exponential draws from its generator per sampled step (none when greedy). Logprobs are
those of the raw model distribution (log_softmax of the input logits, before penalties and
temperature, as vLLM v1 returns by default); the input tensor is never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from deltaserve.engine.request.sampling_params import SAMPLING_EPS, SamplingParams
from deltaserve.engine.request.structured import GrammarState, apply_bitmask
from deltaserve.kernels.transfer import tensor_on

_Q_MIN = 1e-10  # floor for exponential noise, so probs / q is always finite


@dataclass
class SamplingRow:
    """One sequence in the step. `banned_ids` are masked only while the row has fewer than
    `params.min_tokens` outputs; the engine fills it with `params.stop_ids(tokenizer eos ids)`.
    `grammar` is the row's structured-output state (None: unconstrained); `forced`, if set, is
    the only token the row may sample."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    banned_ids: Sequence[int] = ()
    grammar: GrammarState | None = None
    forced: int | None = None


@dataclass
class TokenLogprobs:
    """Raw-distribution logprob of the chosen token, its 1-based rank (1 + the number of tokens
    with a strictly larger logprob) and the `params.logprobs` most likely tokens."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _padded(id_lists: Sequence[Sequence[int]], fill: int, device) -> torch.Tensor:
    """`[B, L]` long tensor of the lists, right-padded with `fill` (L >= 1)."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    width = max(int(lengths.max()), 1)
    out = torch.full((len(id_lists), width), fill, dtype=torch.long)
    flat = torch.tensor(list(chain.from_iterable(id_lists)), dtype=torch.long)
    out[torch.arange(width) < lengths[:, None]] = flat
    return out.to(device, non_blocking=True)


def _counts(id_lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """`[B, V]` float counts of each id per row (padding goes to a dropped column V)."""
    ids = _padded(id_lists, vocab, device)
    counts = torch.zeros(len(id_lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _column(values, device, dtype=torch.float32) -> torch.Tensor:
    return tensor_on(values, device, dtype).unsqueeze(1)


class Sampler:
    """Stateless; see the module docstring for the order of operations and invariants."""

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """`argmax`: each row's largest entry (`x.argmax(dim=-1)`'s values; the model backend's
        `argmax_rows`, which may be a native kernel), torch's where None: the greedy choice, and the
        sampled rows' choice over probs / noise."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        if not rows:
            return SamplerOutput([], [])
        x = self.penalized_logits(logits, rows)
        argmax = argmax or (lambda t: t.argmax(dim=-1))
        tokens = argmax(x)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = tensor_on(sampled, x.device)
            sub = [rows[i] for i in sampled]
            probs = self.sampling_probs(x[idx], [r.params for r in sub])
            q = exp_noise(probs.shape, [r.generator for r in sub], x.device)
            tokens[idx] = argmax(probs / q)
        return SamplerOutput(tokens.tolist(), self._logprobs(logits, tokens, rows))

    @staticmethod
    def reads_outputs(params: SamplingParams, num_outputs: int) -> bool:
        """Whether `penalized_logits` reads a row's output ids: a repetition, frequency or presence
        penalty, or a min_tokens ban still on after `num_outputs` outputs."""
        return (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
            or num_outputs < params.min_tokens
        )

    @classmethod
    def penalized_logits(cls, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Steps 0-2 (logit bias, penalties, min_tokens bans, grammar masks) on a fp32 copy of `logits`; `logits`
        itself where it is fp32 and no row has any of them (callers never write to the result)."""
        ps = [r.params for r in rows]
        rep = any(p.repetition_penalty != 1.0 for p in ps)
        freq_pres = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in ps)
        bans = [r.banned_ids if len(r.output_ids) < r.params.min_tokens else () for r in rows]
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        forced = [(i, r.forced) for i, r in enumerate(rows) if r.forced is not None]
        biased = any(p.logit_bias for p in ps)
        if not (rep or freq_pres or any(bans) or constrained or forced or biased):
            return logits.to(torch.float32)
        x = logits.to(torch.float32, copy=True)
        if biased:
            cells = [(i, t, b) for i, p in enumerate(ps) for t, b in (p.logit_bias or {}).items()]
            rows_, cols, vals = zip(*cells)
            x.index_put_(
                (tensor_on(list(rows_), x.device), tensor_on(list(cols), x.device)),
                tensor_on(list(vals), x.device, torch.float32),
                accumulate=True,
            )
        cls._penalize(x, rows, ps, rep, freq_pres)
        unbanned = x[constrained] if constrained else None
        cls._ban(x, bans)
        apply_bitmask(x, constrained, [rows[i].grammar.bitmask() for i in constrained], unbanned)
        if forced:
            idx = tensor_on([i for i, _ in forced], x.device)
            tok = tensor_on([t for _, t in forced], x.device)
            x[idx] = float("-inf")
            x[idx, tok] = 0.0
        return x

    @staticmethod
    def _penalize(
        x: torch.Tensor, rows: list[SamplingRow], ps: list[SamplingParams], rep: bool, freq_pres: bool
    ) -> None:
        """Repetition (`rep`: some row has one), frequency and presence (`freq_pres`) penalties;
        `ps` the rows' params."""
        if not (rep or freq_pres):
            return
        vocab, dev = x.shape[1], x.device
        out_counts = _counts([r.output_ids for r in rows], vocab, dev)
        if rep:
            seen = (_counts([r.prompt_ids for r in rows], vocab, dev) + out_counts) > 0
            rp = _column([p.repetition_penalty for p in ps], dev)
            x.copy_(torch.where(seen, torch.where(x > 0, x / rp, x * rp), x))
        if freq_pres:
            x -= _column([p.frequency_penalty for p in ps], dev) * out_counts
            x -= _column([p.presence_penalty for p in ps], dev) * (out_counts > 0).float()

    @staticmethod
    def _ban(x: torch.Tensor, lists: list) -> None:
        """Row i's `lists[i]` (its banned ids while under min_tokens, else empty) to -inf."""
        if not any(lists):
            return
        vocab = x.shape[1]
        mask = torch.zeros(len(lists), vocab + 1, dtype=torch.bool, device=x.device)
        mask.scatter_(1, _padded(lists, vocab, x.device), True)
        x.masked_fill_(mask[:, :vocab], float("-inf"))

    @staticmethod
    def sampling_probs(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        """Step 4's distribution: temperature, min_p, top-k, top-p on `[S, V]` logits (one
        params per row), as probabilities (removed tokens exactly 0)."""
        dev, neg_inf = x.device, float("-inf")
        x = x / _column([max(p.temperature, SAMPLING_EPS) for p in ps], dev)
        if any(p.min_p > 0 for p in ps):
            probs = torch.softmax(x, dim=-1)
            floor = _column([p.min_p for p in ps], dev) * probs.amax(dim=-1, keepdim=True)
            x = x.masked_fill(probs < floor, neg_inf)
        rows = [j for j, p in enumerate(ps) if p.top_k > 0 or p.top_p < 1.0]
        if len(rows) == len(ps):
            x = Sampler._top_k_top_p(x, ps)
        elif rows:
            idx = tensor_on(rows, dev)
            x[idx] = Sampler._top_k_top_p(x[idx], [ps[j] for j in rows])
        return torch.softmax(x, dim=-1)

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        """Mask `[S, V]` logits to each row's top-k, then top-p set. Only candidates are
        sorted: `topk` over the largest k (widened to hold ties), a full sort only when a row
        has no top-k."""
        vocab, dev, neg_inf = x.shape[1], x.device, float("-inf")
        k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps]
        desc = (x.topk(max(k), dim=-1) if max(k) < vocab else x.sort(dim=-1, descending=True)).values
        kth = desc.gather(1, tensor_on(k, dev).unsqueeze(1) - 1)
        x = x.masked_fill(x < kth, neg_inf)
        if any(p.top_p < 1.0 for p in ps):
            width = int((x > neg_inf).sum(dim=-1).max())
            if width > desc.shape[1]:
                desc = x.topk(width, dim=-1).values
            probs = torch.softmax(desc.masked_fill(desc < kth, neg_inf), dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            target = _column([p.top_p if p.top_p < 1.0 else 2.0 for p in ps], dev)
            n_kept = (mass_before < target).sum(dim=-1, keepdim=True)
            x = x.masked_fill(x < desc.gather(1, n_kept - 1), neg_inf)
        return x

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if not want:
            return out
        idx = tensor_on(want, logits.device)
        lp = torch.log_softmax(logits[idx].float(), dim=-1)
        chosen = tokens[idx].unsqueeze(1)
        chosen_lp = lp.gather(1, chosen)
        ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()
        kmax = min(max(rows[i].params.logprobs for i in want), lp.shape[1])
        top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
        top_v, top_i, chosen_lp = top_v.tolist(), top_i.tolist(), chosen_lp.squeeze(1).tolist()
        chosen = chosen.squeeze(1).tolist()
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            out[i] = TokenLogprobs(chosen[j], chosen_lp[j], ranks[j], dict(zip(top_i[j][:n], top_v[j][:n])))
        return out


def exp_noise(shape, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """Exp(1) noise `[S, V]` for the exponential race (argmax(p / q) ~ p): row j from
    `generators[j]`, or from the global RNG if None; floored at `_Q_MIN`."""
    q = torch.empty(shape, dtype=torch.float32, device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), shape[1], device=device).exponential_()
    for j, g in enumerate(generators):
        if g is not None:
            q[j] = torch.empty(shape[1], device=g.device).exponential_(generator=g).to(device, non_blocking=True)
    return q.clamp_min_(_Q_MIN)
