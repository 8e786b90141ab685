"""Speculative decoding never changes a greedy answer: spec on == spec off token for token, for
ngram and suffix drafts, over prefix hits, zero-draft steps, preemption and chunked prefill, in
both families (fp32); seeded sampled outputs repeat."""

import random

import pytest

from deltaserve import SamplingParams

from .helpers import copy_prompts, engine, loopy_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# adaptive k off: drafts whenever the drafter has some, so rejections and zero-draft steps occur
METHODS = [
    {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False},
]


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpt(request, tmp_path_factory):
    return loopy_tiny(tmp_path_factory.mktemp(request.param), request.param)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def workload(seed: int, n: int = 4) -> list[list[int]]:
    """Copy-heavy prompts of 6 to 60 tokens."""
    rng = random.Random(seed)
    return copy_prompts(2000, [rng.randrange(5, 30) for _ in range(n)], seed)


@pytest.mark.parametrize("pressure", [False, True], ids=["hits", "preemption"])
@pytest.mark.parametrize("spec", METHODS, ids=[m["method"] for m in METHODS])
def test_greedy_spec_on_equals_off(ckpt, spec, pressure):
    """Two waves of requests, chunks of 29 tokens: the second extends the first's prompts (prefix
    hits) in a roomy cache, or, without prefix caching, the pages are few (preemption)."""
    kw = dict(num_pages=26, max_model_len=100, prefix=False) if pressure else dict(num_pages=80)
    on, off = engine(ckpt, spec, **kw), engine(ckpt, None, **kw)
    first = workload(0)
    for prompts in (first, [p + q for p, q in zip(first, workload(2, 3))] + workload(1, 1)):  # then hits
        assert tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(
            off.generate(prompts, GREEDY, use_tqdm=False)
        )
        on.check_integrity()
    stats = on.stats()
    sd, pc = stats["spec_decode"], stats.get("prefix_cache", {})
    assert sd["draft_tokens"] > 0 and sd["accepted_tokens"] > 0, sd
    assert sd["accepted_tokens"] < sd["draft_tokens"], "some drafts were rejected"
    assert sd["undrafted"] > 0, "verify steps held sequences without drafts"
    assert (stats["preemptions"] if pressure else pc.get("hits", 0)) > 0, (stats, pc)
    assert stats["steps"] < off.stats()["steps"], "accepted drafts saved steps"


def test_seeded_sampling_repeats(ckpt):
    """Rejection sampling draws from each sequence's own generator: the same seeds give the same
    tokens on a fresh engine; other seeds give others."""
    params = [SamplingParams(temperature=0.2, top_p=0.95, max_tokens=16, ignore_eos=True, seed=s) for s in range(3)]
    prompts = workload(7, 3)
    a, b = engine(ckpt, METHODS[0]), engine(ckpt, METHODS[0])
    first = tokens(a.generate(prompts, params, use_tqdm=False))
    assert tokens(b.generate(prompts, params, use_tqdm=False)) == first
    other = [SamplingParams(temperature=0.2, top_p=0.95, max_tokens=16, ignore_eos=True, seed=s + 9) for s in range(3)]
    assert tokens(b.generate(prompts, other, use_tqdm=False)) != first
    sd = a.stats()["spec_decode"]
    assert sd["draft_tokens"] > 0 and sd["accepted_tokens"] > 0, sd


def test_adaptive_k_engages_through_shadow_probes(ckpt):
    """Adaptive k on (the default): drafting starts only once a shadow probe (scored, never
    verified) finds the drafts pay; outputs stay the target's."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    on, off = engine(ckpt, spec, prefix=False), engine(ckpt, None, prefix=False)
    prompts = workload(3)
    assert tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    sd = on.stats()["spec_decode"]
    assert sd["shadow_probes"] > 0 and sd["accepted_tokens"] > 0, sd
