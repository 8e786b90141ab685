"""Sampler against exact expectations and a slow, per-row float64 oracle written here."""

import random

import pytest
import torch

from deltaserve.engine.exec.sampler import Sampler, SamplingRow
from deltaserve.engine.request.sampling_params import SamplingParams as SP

sampler = Sampler()


def row(params=None, gen=None, prompt=(), out=(), banned=()):
    return SamplingRow(params or SP(), gen, list(prompt), list(out), list(banned))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def oracle_probs(logits: torch.Tensor, p: SP) -> torch.Tensor:
    """Per-row reference of temperature -> min_p -> top-k -> top-p; ties at a cut are kept."""
    x = logits.double() / p.temperature
    keep = torch.ones(x.numel(), dtype=torch.bool)
    if p.min_p > 0:
        pr = torch.softmax(x, 0)
        keep &= pr >= p.min_p * pr.max()
    if p.top_k > 0:
        vals = sorted(x[keep].tolist(), reverse=True)
        if p.top_k < len(vals):
            keep &= x >= vals[p.top_k - 1]
    if p.top_p < 1:
        pr = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
        cum, last = 0.0, None
        for i in sorted(range(x.numel()), key=lambda i: -pr[i].item()):
            cum += pr[i].item()
            last = pr[i].item()
            if cum >= p.top_p:
                break
        keep &= pr >= last
    return torch.softmax(x.masked_fill(~keep, float("-inf")), 0)


def near_boundary(logits, p: SP, eps=1e-4) -> bool:
    """True when fp32 rounding could flip a min_p / top-p decision (skip such cases)."""
    x = logits.double() / p.temperature
    pr = torch.softmax(x, 0)
    if p.min_p > 0 and ((pr - p.min_p * pr.max()).abs() < eps).any():
        return True
    if p.top_p < 1:
        q = oracle_probs(logits, SP(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p))
        cum = q.sort(descending=True).values.cumsum(0)
        return bool(((cum - p.top_p).abs() < eps).any())
    return False


def test_greedy_is_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 2.0, 9.0]])
    out = sampler(logits, [row(SP(temperature=0)), row(SP(top_k=1, temperature=0.7), gen(1))])
    assert out.token_ids == [1, 3] and out.logprobs == [None, None]


def test_input_untouched_and_empty_batch():
    logits = torch.randn(3, 10)
    before = logits.clone()
    sampler(
        logits,
        [
            row(SP(repetition_penalty=1.5, presence_penalty=1), out=[1, 2]),
            row(SP(top_p=0.5, min_p=0.1)),
            row(SP(temperature=0), banned=[0]),
        ],
    )
    assert torch.equal(logits, before)
    assert sampler(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 5), [row()])


def test_penalties_exact():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 0.0, -3.0, 1.0, 4.0],
            [2.0, -1.0, 0.5, 0.0, -3.0, 1.0, 4.0],
            [2.0, -1.0, 0.5, 0.0, -3.0, 1.0, 4.0],
        ]
    )
    rows = [
        row(
            SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt=[0, 1, 6],
            out=[2, 2, 4, 0, 2],
        ),
        row(prompt=[0, 1], out=[2, 2]),
        row(SP(frequency_penalty=-1.0, presence_penalty=2.0), prompt=[1, 6], out=[3, 3, 5]),
    ]
    got = Sampler.penalized_logits(logits, rows)
    for b, r in enumerate(rows):
        p, seen = r.params, set(r.prompt_ids) | set(r.output_ids)
        for t in range(logits.shape[1]):
            v = logits[b, t].item()
            if t in seen:
                v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            c = r.output_ids.count(t)
            v -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            assert got[b, t].item() == v, (b, t)


def test_penalties_random_vs_oracle():
    rnd = random.Random(0)
    V = 40
    rows, logits = [], torch.randn(6, V) * 3
    for _ in range(6):
        rows.append(
            row(
                SP(
                    repetition_penalty=rnd.choice([1.0, 0.7, 1.3]),
                    frequency_penalty=rnd.uniform(-2, 2),
                    presence_penalty=rnd.uniform(-2, 2),
                ),
                prompt=[rnd.randrange(V) for _ in range(rnd.randint(0, 30))],
                out=[rnd.randrange(V) for _ in range(rnd.randint(0, 20))],
            )
        )
    got = Sampler.penalized_logits(logits, rows)
    for b, r in enumerate(rows):
        p, seen = r.params, set(r.prompt_ids) | set(r.output_ids)
        for t in range(V):
            v = logits[b, t].item()
            if t in seen:
                v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            c = r.output_ids.count(t)
            v -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
            assert got[b, t].item() == pytest.approx(v, abs=1e-5)


def test_min_tokens_bans_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0]] * 4)
    p = SP(temperature=0, min_tokens=2)
    rows = [
        row(p, banned=[3]),
        row(p, out=[1], banned=[3, 4]),
        row(p, out=[1, 1], banned=[3]),
        row(SP(min_tokens=2, temperature=1.0), gen(0), banned=[3, 4]),
    ]
    assert sampler(logits, rows).token_ids[:3] == [4, 2, 3]
    for s in range(50):
        rows[3].generator = gen(s)
        assert sampler(logits, rows).token_ids[3] not in (3, 4)


def test_top_p_and_top_k_ties_exact():
    logits = torch.tensor([1.0, 1.0, 1.0, 0.0, -1.0])

    def kept(p):
        return (Sampler.sampling_probs(logits[None], [p])[0] > 0).nonzero().flatten().tolist()

    assert kept(SP(top_p=0.5)) == [0, 1, 2]  # two of the tied tokens reach 0.5: all three kept
    assert kept(SP(top_p=0.2)) == [0, 1, 2]
    assert kept(SP(top_p=0.95)) == [0, 1, 2, 3]
    assert kept(SP(top_k=2)) == [0, 1, 2]
    assert kept(SP(top_k=4)) == [0, 1, 2, 3]
    assert kept(SP(top_k=100)) == [0, 1, 2, 3, 4]
    assert kept(SP(min_p=0.5)) == [0, 1, 2]
    steep = torch.tensor([3.0, 2.0, 1.0, 0.0])  # probs ~ .644 .237 .087 .032

    def kept2(p):
        return (Sampler.sampling_probs(steep[None], [p])[0] > 0).sum().item()

    assert [kept2(SP(top_p=t)) for t in (0.5, 0.7, 0.9, 0.97, 1.0)] == [1, 2, 3, 4, 4]


def test_sampling_probs_vs_oracle():
    torch.manual_seed(0)
    rnd = random.Random(0)
    V, cases, checked = 30, [], 0
    for _ in range(300):
        logits = torch.randn(V) * rnd.choice([0.5, 2.0, 5.0])
        if rnd.random() < 0.5:
            logits = (logits * 2).round() / 2  # many exact ties
        p = SP(
            temperature=rnd.choice([0.3, 0.7, 1.0, 1.8]),
            top_p=rnd.choice([1.0, 0.3, 0.8, 0.95]),
            top_k=rnd.choice([0, 1, 3, 10, 50]),
            min_p=rnd.choice([0.0, 0.05, 0.3]),
        )
        if not near_boundary(logits, p):
            cases.append((logits, p))
    got = Sampler.sampling_probs(torch.stack([c[0] for c in cases]), [c[1] for c in cases])
    for (logits, p), g in zip(cases, got):
        want = oracle_probs(logits, p)
        assert torch.equal(g > 0, want > 0), p
        assert torch.allclose(g.double(), want, atol=1e-5)
        checked += 1
    assert checked > 200


def test_frequencies_match_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    for p in (SP(temperature=0.8), SP(temperature=1.3, top_k=4), SP(top_p=0.8, min_p=0.02)):
        want = oracle_probs(logits, p)
        torch.manual_seed(1234)
        n = 40000
        toks = torch.tensor(sampler(logits.expand(n, -1), [row(p)] * n).token_ids)
        freq = torch.bincount(toks, minlength=6).double() / n
        tol = 5 * (want * (1 - want) / n).sqrt() + 1e-9
        assert ((freq - want).abs() <= tol).all(), (p, freq, want)
        assert (freq[want == 0] == 0).all()
        m = 4000  # every row with its own seeded generator
        toks = torch.tensor(sampler(logits.expand(m, -1), [row(p, gen(s)) for s in range(m)]).token_ids)
        freq = torch.bincount(toks, minlength=6).double() / m
        assert ((freq - want).abs() <= 5 * (want * (1 - want) / m).sqrt() + 1e-9).all(), (p, freq)


def test_seeded_row_is_batch_invariant():
    V, steps = 64, 8
    step_logits = torch.randn(steps, 6, V, generator=gen(99))
    specs = [  # (params, seed or None, prompt)
        (SP(temperature=0.9, top_p=0.9, top_k=20, repetition_penalty=1.2, frequency_penalty=0.3), 1234, [1, 2, 3]),
        (SP(temperature=1.5, min_p=0.01), 77, [4]),
        (SP(temperature=0.7, presence_penalty=0.5), None, [5, 6]),
        (SP(temperature=0), None, [7]),
        (SP(temperature=1.0, top_k=5, logprobs=2), 5, []),
        (SP(top_k=1), 8, [9]),
    ]

    def run(which, order_seed):
        rows = [row(p, gen(s) if s is not None else None, prompt) for p, s, prompt in specs]
        shuffler, seqs = random.Random(order_seed), {i: [] for i in which}
        for t in range(steps):
            order = list(which)
            shuffler.shuffle(order)
            out = sampler(step_logits[t, order], [rows[i] for i in order]).token_ids
            for i, tok in zip(order, out):
                rows[i].output_ids.append(tok)
                seqs[i].append(tok)
        return seqs

    alone = {i: run([i], 0)[i] for i in (0, 1, 3, 4, 5)}
    for order_seed in range(4):
        mixed = run(range(6), order_seed)
        for i, seq in alone.items():
            assert mixed[i] == seq, (i, order_seed)
    assert len(set(alone[0])) > 1  # randomness is actually in play
    other = [row(specs[0][0], gen(4321), specs[0][2])]
    assert [sampler(step_logits[t, :1], other).token_ids[0] for t in range(steps)] != alone[0]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 3
    rows = [
        row(SP(logprobs=0, temperature=0.5, repetition_penalty=1.5), gen(0), prompt=[1, 2]),
        row(SP(logprobs=3, presence_penalty=2.0), gen(1), out=[4]),
        row(SP(temperature=0)),
        row(SP(logprobs=20, temperature=0, frequency_penalty=2.0), out=[int(logits[3].argmax())] * 3),
    ]
    out = sampler(logits, rows)
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for b in (0, 1, 3):
        got, tok = out.logprobs[b], out.token_ids[b]
        assert got.token_id == tok
        assert got.logprob == pytest.approx(lp[b, tok].item(), abs=1e-6)
        assert got.rank == 1 + int((lp[b] > lp[b, tok]).sum())
        n = rows[b].params.logprobs
        assert len(got.top) == n
        want = lp[b].topk(n) if n else None
        if n:
            assert list(got.top) == want.indices.tolist()
            assert list(got.top.values()) == pytest.approx(want.values.tolist(), abs=1e-6)
    assert out.logprobs[3].rank > 1  # the penalty moved greedy off the raw argmax


def test_penalized_logits_copy_only_when_something_changes_them():
    """No penalty, ban, grammar or forced token: the fp32 input itself (no copy a step); otherwise a
    copy, and the input is left as it was."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [1.5, 0.0, 3.0, -2.0]])
    plain = [row(), row(SP(temperature=0.7))]
    assert Sampler.penalized_logits(logits, plain) is logits
    before = logits.clone()
    for rows in (
        [row(SP(presence_penalty=1.0), out=[1]), row()],
        [row(SP(min_tokens=2), banned=[2]), row()],
    ):
        got = Sampler.penalized_logits(logits, rows)
        assert got is not logits and torch.equal(logits, before)
        assert not torch.equal(got, logits)
    out = Sampler()(logits, plain)
    assert out.token_ids[0] == 1 and torch.equal(logits, before)


def test_logit_bias_is_added_before_penalties_per_row():
    """Exact: row 0's bias lifts token 3 over the argmax; row 1 (no bias) is untouched; logprobs
    stay those of the raw logits."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0]])
    biased = SP(temperature=0.0, logprobs=0, logit_bias={3: 4.0, 1: -1.5})
    out = sampler(logits, [row(biased), row(SP(temperature=0.0))])
    assert out.token_ids == [3, 1]
    x = Sampler.penalized_logits(logits, [row(biased), row(SP())])
    assert x[0].tolist() == [0.0, 3.5, 1.0, 6.0] and x[1].tolist() == logits[1].tolist()
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], 0)[3].item())
