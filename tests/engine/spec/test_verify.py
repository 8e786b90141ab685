"""The acceptance rule against the exact target distribution: greedy keeps exactly the target's
greedy tokens; rejection sampling of point-mass drafts emits each token with the target's
probabilities (an exact identity for one position, a seeded frequency test over two)."""

import torch

from deltaserve.engine.spec.verify import accept_greedy, accept_sampled, residual, sample


def test_greedy_keeps_the_matching_prefix_and_adds_the_targets_token():
    assert accept_greedy([5, 6, 7, 8], (5, 6, 7)) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], (5, 6, 7)) == [5, 9]  # corrected at the first mismatch
    assert accept_greedy([4, 6, 7, 8], (5, 6, 7)) == [4]
    assert accept_greedy([3], ()) == [3]  # zero drafts: the target's token


def test_accept_then_residual_is_exactly_the_target():
    """P(out = x) = p(d) [x = d] + (1 - p(d)) residual(p, d)(x) = p(x), for every draft d."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.3, 0.0], dtype=torch.float64)
    for d in range(5):
        mix = (1 - p[d]) * residual(p, d)
        mix[d] += p[d]
        assert torch.allclose(mix, p, atol=1e-15), d
    assert residual(torch.tensor([0.0, 1.0]), 1).sum() == 0  # a point mass on d: never rejected


def test_sample_follows_the_distribution():
    p = torch.tensor([0.1, 0.6, 0.0, 0.3])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(p, g) for _ in range(20000)]), minlength=4)
    assert counts[2] == 0
    assert (counts / 20000 - p).abs().max() < 0.012


def test_two_drafts_preserve_the_target_chain():
    """Rows p0 (first position) and p1 (after draft d1): the first token is ~ p0; the second exists
    only after d1 was kept and is then ~ p1 (its rows are the target's given d1). 40000 seeded
    trials; the bound is ~4.5 standard errors of the largest cell."""
    probs = torch.tensor([[0.2, 0.5, 0.3, 0.0], [0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])
    drafts = (1, 2)
    g = torch.Generator().manual_seed(1)
    n = 40000
    first = torch.zeros(4)
    second = torch.zeros(4)
    lengths = torch.zeros(4)
    for _ in range(n):
        out = accept_sampled(probs, drafts, g)
        first[out[0]] += 1
        lengths[len(out)] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert (first / n - probs[0]).abs().max() < 0.011
    assert (second / second.sum() - probs[1]).abs().max() < 0.015
    # three tokens exactly when both drafts are kept: p0(d1) * p1(d2)
    assert abs(lengths[3] / n - 0.5 * 0.4) < 0.011
    assert lengths[0] == 0 and lengths[1] + lengths[2] + lengths[3] == n


def test_seeded_acceptance_repeats():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), dim=-1)
    runs = [
        [accept_sampled(probs, (7, 8, 9), g) for _ in range(50)]
        for g in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
    ]
    assert runs[0] == runs[1]
