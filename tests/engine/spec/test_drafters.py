"""Drafters (exact proposals), the adaptive draft length, the metrics and the config's checks."""

import random
import types

import pytest

from deltaserve import SamplingParams
from deltaserve.engine.request.sequence import Sequence
from deltaserve.engine.spec.adaptive import MAX_FREE_PROBE_INTERVAL, PROBE_DRAFTS, AdaptiveK, SpecMetrics
from deltaserve.engine.spec.config import SpecConfig
from deltaserve.engine.spec.decoder import SpecDecoder
from deltaserve.engine.spec.drafters import NgramDrafter, SuffixDrafter
from deltaserve.engine.spec.proposer import ModelFreeProposer


def seq(prompt, output=()):
    s = Sequence(0, "r", 0, list(prompt), SamplingParams())
    s.output_ids = list(output)
    return s


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    d = NgramDrafter(2, 3)
    s = seq([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    assert d.propose(s, 3) == [4, 5, 7]  # (2, 3) was last followed by 4 (not 9)
    s.output_ids.append(8)  # (3, 8) never occurred, nor (2, 3, 8)
    assert d.propose(s, 3) == []
    assert NgramDrafter(3, 3).propose(seq([1, 2, 5, 6, 1, 2]), 2) == []  # min 3: (1, 2) is too short


def test_ngram_copies_through_its_own_proposal_for_loops():
    """A loop of period 2: the match ends one period back, and the draft continues the loop."""
    assert NgramDrafter(2, 4).propose(seq([7, 5, 6, 5, 6, 5, 6]), 5) == [5, 6, 5, 6, 5]


def test_ngram_index_grows_incrementally():
    d = NgramDrafter(1, 2)
    s = seq([4, 1, 2])
    assert d.propose(s, 2) == []
    s.output_ids += [3, 1]
    assert d.propose(s, 2) == [2, 3]
    s.output_ids += [2, 3, 1]
    assert d.propose(s, 4) == [2, 3, 1, 2]


def test_suffix_follows_the_most_frequent_continuation_and_stops_when_unlikely():
    d = SuffixDrafter(depth=4, min_prob=0.3, keep=4)
    s = seq([1, 2, 3, 1, 2, 3, 1, 2, 4, 0, 1, 2])
    # after (1, 2): 3 twice, 4 once -> 3 (2/3); after (1, 2, 3): 1 twice -> 1; then (2, 3, 1) -> 2 ...
    assert d.propose(s, 3) == [3, 1, 2]
    strict = SuffixDrafter(depth=4, min_prob=0.7, keep=4)
    assert strict.propose(seq([1, 2, 3, 1, 2, 3, 1, 2, 4, 0, 1, 2]), 3) == []  # 2/3 < 0.7


def test_suffix_session_store_serves_later_requests_and_forgets_the_oldest():
    d = SuffixDrafter(depth=3, min_prob=0.0, keep=1)
    a = seq([10, 11], [12, 13, 14])
    d.propose(a, 1)
    d.finished(a)
    b = seq([5, 11, 12])
    assert d.propose(b, 2) == [13, 14]  # (11, 12) continued in the earlier request
    c = seq([50, 51, 52])
    d.propose(c, 1)
    d.finished(c)  # keep=1: a's tokens leave the store
    assert d.propose(seq([6, 11, 12]), 2) == []
    assert d.session.next and all(sum(v.values()) > 0 for v in d.session.next.values())


def test_adaptive_k_follows_acceptance_and_turns_off_then_probes():
    k = AdaptiveK(k_max=6, cost=0.1, probe_interval=4)
    assert 1 <= k.next_k() < 6  # the prior: one pass in two tests
    for _ in range(10):
        k.observe(6, 6)
    assert k.next_k() == 6
    for _ in range(80):
        k.observe(3, 0)
    assert [(k.next_k(), k.probe_due) for _ in range(4)] == [(0, False)] * 3 + [(0, True)]
    k.probe_taken()
    k.probe_scored(6, 0)  # the probe's score: it did not pay, the next one 8 steps on
    assert [(k.next_k(), k.probe_due) for _ in range(8)] == [(0, False)] * 7 + [(0, True)]
    assert AdaptiveK(4, 0.1, 4, adaptive=False).next_k() == 4


def probes(k: AdaptiveK, steps: int) -> list[int]:
    """The decode steps (1-based) of the next `steps` at which a probe is due (none is taken)."""
    out = []
    for i in range(steps):
        assert k.next_k() == 0
        if k.probe_due:
            out.append(i + 1)
    return out


def test_adaptive_k_weighs_a_drafted_steps_cost_and_backs_off_its_probes():
    """Costs 0.25 a draft, 0.25 a drafted step, 0.5 a rollback: the prior (a = 1/2) does not pay
    (k = 1: 1.5 tokens for 1.75 steps), so a request verifies nothing and probes from its first
    decode step; a probe stays due until taken, and probes that do not make drafting pay come
    ever rarer (8, then 16 steps on)."""
    k = AdaptiveK(4, cost=0.25, probe_interval=4, step_cost=0.25, rollback_cost=0.5)
    assert k.rate(1) == pytest.approx(1.5 / 1.75) and k.best_k() == 0
    assert probes(k, 2) == [1, 2]  # due at once; not taken (no draft): still due
    k.probe_taken()
    assert probes(k, 3) == []  # out: no other probe, the idle count waits
    k.probe_scored(4, 0)  # scored: a = 1/3
    assert probes(k, 8) == [8]
    k.probe_taken()
    k.probe_scored(4, 0)
    assert probes(k, 16) == [16]


def test_adaptive_k_turns_on_after_an_accepted_probe_and_off_when_rejected():
    """Same costs: a probe whose 4 drafts all came true (a = 5/6) makes k = 4 the best (3.59
    tokens for 2.51 steps); a fully rejected verify step (a = 12/17) leaves k = 2 (2.20 for 2.00);
    a second one (a = 0.61) makes no k pay, and the next probe is `probe_interval` steps on."""
    k = AdaptiveK(4, cost=0.25, probe_interval=4, step_cost=0.25, rollback_cost=0.5)
    assert probes(k, 1) == [1]
    k.probe_taken()
    k.probe_scored(4, 4)
    assert k.acceptance == pytest.approx(5 / 6) and k.next_k() == 4 and not k.probe_due
    assert k.rate(4) == pytest.approx((1 - (5 / 6) ** 5) * 6 / (2.25 + 0.5 * (1 - (5 / 6) ** 4)))
    k.observe(4, 0)
    assert k.acceptance == pytest.approx(12 / 17) and k.next_k() == 2
    k.observe(2, 0)
    assert probes(k, 4) == [4]


def test_free_probes_overlap_and_back_off_to_a_few_steps():
    """Probes that cost nothing (a model-free proposer): due from the first decode step at an
    interval of 1, several out at once; each failed one doubles the interval up to
    MAX_FREE_PROBE_INTERVAL, one that came true in full sets it back to 1 and buys a trial step of
    k_max drafts."""
    k = AdaptiveK(4, cost=0.25, probe_interval=16, step_cost=0.25, rollback_cost=0.5, free=True)
    assert k.probe_k == min(4, PROBE_DRAFTS) and probes(k, 3) == [1, 2, 3]  # none taken (no draft): due at every step
    k.probe_taken()
    k.probe_taken()
    assert k.out == 2 and probes(k, 1) == [1]  # others may go out while two are
    k.probe_scored(4, 0)
    k.probe_scored(4, 0)
    k.probe_taken()  # stays out to the end
    assert k.interval == 4 and probes(k, 4) == [4]
    for accepted in (0, 1, 2, 0):
        k.probe_taken()
        k.probe_scored(4, accepted)
    most = MAX_FREE_PROBE_INTERVAL
    assert k.interval == most and probes(k, most) == [most]
    k.probe_taken()
    k.probe_scored(4, 4)
    assert k.best == 0 and k.interval == 1 and k.out == 1
    assert k.next_k() == 4  # the trial: 2 x the 4 drafts that came true, at most k_max
    k.observe(4, 1)
    assert k.next_k() == 0


def test_decoder_scores_overlapping_probes_as_their_tokens_decode():
    """ngram: a request starts with drafting off (the prior does not pay) and probes at every decode
    step, several out at once; each is scored once the tokens it guessed are decoded, and the first
    fully accepted one turns drafting on."""
    dec = SpecDecoder(SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 3}), 64)
    runner = types.SimpleNamespace(keep_hidden=False)
    s = seq([1, 2, 3, 4, 5, 1, 2])
    s.num_computed = s.num_tokens - 1
    out = []
    for t in [3, 4, 5]:
        dec.prepare(runner, [s])
        out.append((len(dec._seqs[s].shadow), dec.propose(s, 3)))
        s.output_ids.append(t)
        s.num_computed += 1
    assert out == [(1, []), (2, []), (3, [])] and dec.probes == 0
    dec.prepare(runner, [s])  # the first probe ([3, 4, 5]) came true: drafting is on
    assert dec.probes == 1 and len(dec._seqs[s].shadow) == 2
    assert dec.propose(s, 3) == [1, 2, 3][: dec._seqs[s].control.best] and dec._seqs[s].control.best > 0


def test_adaptive_k_counts_a_draft_models_forwards():
    """At acceptance ~0.99, 4 drafts pay at 0.25 a draft but not when each also costs a target-sized
    drafter forward (the target as its own draft: 1.25 a draft), which turns drafting off."""
    cheap, dear = (AdaptiveK(4, cost=c, probe_interval=4, step_cost=0.25, rollback_cost=0.5) for c in (0.25, 1.25))
    for k in (cheap, dear):
        for _ in range(50):
            k.observe(4, 4)
    assert cheap.best_k() == 4 and dear.best_k() == 0
    assert dear.next_k() == 0  # whole proposals came true, but no trial: drafting never pays for it
    spec = SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    proposer = ModelFreeProposer(NgramDrafter(2, 3))
    proposer.draft_cost = 1.0
    assert SpecDecoder(spec, 64, proposer=proposer)._state(seq([1, 2, 3])).control.cost == spec.draft_cost + 1.0


def test_metrics_count_by_position():
    m = SpecMetrics(3)
    m.observe(3, 1)
    m.observe(2, 2)
    m.observe(0, 0)
    st = m.stats()
    assert st["drafted_by_position"] == [2, 2, 1] and st["accepted_by_position"] == [2, 1, 0]
    assert (st["drafts"], st["undrafted"], st["draft_tokens"], st["accepted_tokens"]) == (2, 1, 5, 3)
    assert st["mean_accepted_length"] == 2.5 and st["acceptance_rate"] == 0.6


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram"}', "needs"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}', "exceed"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "required by, and only by"),
        ('{"method": "suffix", "num_speculative_tokens": 2, "model": "/m"}', "required by, and only by"),
        ('{"method": "draft_model", "num_speculative_tokens": 2, "model": 3}', "checkpoint directory path"),
        ("[1]", "object"),
        ("{", "JSON"),
    ],
)
def test_config_refuses_bad_values(value, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig.parse(value)


def test_config_parses_vllm_shape():
    c = SpecConfig.parse({"method": "suffix", "num_speculative_tokens": 5, "suffix_max_depth": 12})
    assert (c.method, c.num_speculative_tokens, c.suffix_max_depth) == ("suffix", 5, 12)
    assert SpecConfig.parse(None) is None and SpecConfig.parse("") is None
    c = SpecConfig.parse('{"method": "draft_model", "model": "/ckpt", "num_speculative_tokens": 3}')
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/ckpt", 3)


def test_bench_workloads_copy_a_passage_and_free_form_does_not():
    """The copy requests (an edit of a passage) ask for text their prompt holds; the free-form ones
    (arithmetic) do not hold their answers."""
    from deltaserve.bench.spec import conversations
    from deltaserve.train.tasks import arithmetic, copy_edit

    rng = random.Random(0)
    copies = [copy_edit(rng, 6) for _ in range(4)]
    assert conversations("copy", 4, 0, 6) == [c.messages for c in copies]
    assert any(c.expect in c.messages[0]["content"] for c in copies), "an exact repeat"
    assert all(len(c.expect) > 100 and c.expect[:20] in c.messages[0]["content"] for c in copies)
    rng = random.Random(0)
    sums = [arithmetic(rng) for _ in range(4)]
    assert conversations("free", 4, 0, 6) == [a.messages for a in sums]
    assert not any(a.content in a.messages[0]["content"] for a in sums)


def test_best_k_is_the_argmax_of_rate():
    """`best_k`'s running powers pick what the argmax of `rate` over [0, k_max] picks (ties: the
    smaller k), over acceptances and costs."""
    rng = random.Random(3)
    for _ in range(300):
        k = AdaptiveK(
            rng.randint(1, 8), rng.uniform(0, 1), 4, step_cost=rng.uniform(0, 1), rollback_cost=rng.uniform(0, 1)
        )
        for _ in range(rng.randint(0, 6)):
            d = rng.randint(1, k.k_max)
            k.observe(d, rng.randint(0, d))
        rates = [k.rate(j) for j in range(k.k_max + 1)]
        assert k.best_k() == max(range(k.k_max + 1), key=lambda j: (rates[j], -j))


def test_prepare_asks_only_for_the_rows_a_capped_step_leaves():
    """Under `max_step_rows` (the native bf16 verify cap): nothing is asked for while the decodes fill
    it; one spare row takes one probe; a draft cut to the spare rows is dropped where the cut k does
    not pay (acceptance 0.7: k = 3 pays, k = 1 does not)."""
    dec = SpecDecoder(SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 3}), 64)
    runner = types.SimpleNamespace(keep_hidden=False)
    a, b = seq([1, 2, 3, 1, 2]), seq([4, 5, 6, 4, 5])
    for s in (a, b):
        s.num_computed = s.num_tokens - 1
    dec.prepare(runner, [a, b], max_step_rows=2)
    assert not dec._seqs and dec.propose(a, 3) == []
    dec.prepare(runner, [a], max_step_rows=2)
    assert len(dec._seqs[a].shadow) == 1
    control = dec._seqs[a].control
    control.passed, control.tested = 69.0, 98.0
    control.best = control.best_k()
    assert control.acceptance == pytest.approx(0.7) and control.best == 3 and control.rate(1) < 1.0
    dec.prepare(runner, [a], max_step_rows=2)
    assert dec.propose(a, 3) == []
    dec.prepare(runner, [a])
    assert dec.propose(a, 3) == [3, 1, 2]


def test_ngram_index_equals_a_rescan_however_it_grows():
    """The index grown in random steps holds, for every n-gram of lo..hi tokens, the position after its
    latest occurrence (a rescan of all tokens), and proposes what a rescan proposes."""
    rng = random.Random(5)
    for _ in range(40):
        lo, hi = rng.randint(1, 3), rng.randint(3, 6)
        d = NgramDrafter(lo, hi)
        s = seq([rng.randrange(6) for _ in range(rng.randint(0, 30))])
        for _ in range(rng.randint(1, 8)):
            got = d.propose(s, 5)
            ids = s.all_ids()
            want_after = {}
            for e in range(1, len(ids)):
                for n in range(lo, min(hi, e) + 1):
                    want_after[tuple(ids[e - n : e])] = e
            assert d._index[s].after == want_after
            fresh = NgramDrafter(lo, hi)
            assert got == fresh.propose(seq(ids), 5)
            s.output_ids += [rng.randrange(6) for _ in range(rng.randint(0, 12))]
