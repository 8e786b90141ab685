"""Hybrid prefix cache end to end: cache on == cache off token for token, restored KDA states
equal cold-computed ones, hits at the last shared unit boundary and at junctions, eviction."""

import random

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.model.config import ModelConfig
from deltaserve.model.context import DenseCache
from deltaserve.tiny import make_tiny

from .test_engine import budget_for, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpt(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), family=request.param, preset="tiny", seed=21)


def make(
    ckpt,
    prefix: bool,
    num_pages=80,
    num_ckpt_slots=12,
    unit=8,
    page_size=4,
    max_num_seqs=4,
    max_num_batched_tokens=29,
    **kw,
) -> LLM:
    cfg = ModelConfig.from_pretrained(ckpt)
    live = budget_for(cfg, max_num_seqs, num_pages, page_size)
    slot = budget_for(cfg, 1, 0, page_size)
    budget = live + (num_ckpt_slots * slot if prefix else 0)
    frac = num_ckpt_slots * slot / budget + 1e-9
    return LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        page_size=page_size,
        kv_cache_memory=budget,
        max_model_len=120,
        progress=False,
        enable_prefix_caching=prefix,
        prefix_match_unit=unit,
        checkpoint_fraction=frac if prefix else 0.25,
        **kw,
    )


def shared_prefix_workload(vocab, seed, prefix_lens, tails):
    rng = random.Random(seed)
    prompts = []
    for plen in prefix_lens:
        base = [rng.randrange(vocab) for _ in range(plen)]
        for t in tails:
            prompts.append(base + [rng.randrange(vocab) for _ in range(t)])
    rng.shuffle(prompts)
    return prompts


def rel_err(got, want) -> float:
    """max |got - want| / max |want|: the engine computes the prefix in chunks (absorbed MLA for
    later chunks) and the cold run in one pass, so fp32 rounding differs slightly."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def same_tokens(on: LLM, off: LLM, prompts) -> bool:
    return tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(off.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("wave", [1, 3])
def test_cache_on_equals_off(ckpt, wave):
    """Prefix lengths just below, at and above the page (4), unit (8), chunk (29) and KDA chunk (64)
    boundaries; run in waves so later requests hit what earlier ones cached."""
    on, off = make(ckpt, True), make(ckpt, False)
    vocab = on.model.config.vocab_size
    prompts = shared_prefix_workload(vocab, wave, [3, 4, 7, 8, 9, 28, 29, 30, 63, 64, 65], [1, 5])
    batches = [prompts[i::wave] for i in range(wave)]
    for batch in batches:
        assert same_tokens(on, off, batch)
        on.check_integrity()
    again = prompts[:6]
    assert same_tokens(on, off, again)
    pc = on.stats()["prefix_cache"]
    assert pc["hits"] > 0 and pc["hit_tokens"] > 0 and pc["checkpoints_stored"] > 0, pc
    on.check_integrity()


def test_cache_on_equals_off_under_preemption_and_eviction(ckpt):
    """30 pages: the least max_model_len allows (prefix sharing within a step saves enough pages
    that 34 no longer preempt)."""
    on = make(ckpt, True, num_pages=30, num_ckpt_slots=3, max_num_seqs=4, max_num_batched_tokens=13)
    off = make(ckpt, False, num_pages=30, max_num_seqs=4, max_num_batched_tokens=13)
    vocab = on.model.config.vocab_size
    for seed in range(3):
        prompts = shared_prefix_workload(vocab, 10 + seed, [17, 33, 40], [2, 9, 3])
        assert same_tokens(on, off, prompts)
        on.check_integrity()
    stats = on.stats()
    pc = stats["prefix_cache"]
    assert stats["preemptions"] > 0 and pc["hits"] > 0, stats
    assert pc["checkpoints_evicted"] > 0 and pc["units_evicted"] > 0, pc


@torch.inference_mode()
def test_restored_states_equal_cold_states(ckpt):
    """Every registered checkpoint holds exactly the state a cold run reaches at its boundary."""
    llm = make(ckpt, True, num_ckpt_slots=16, kda_checkpoint_interval=16)
    vocab = llm.model.config.vocab_size
    prompt = random_prompts(vocab, [70], seed=3)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    cache = llm.cache
    by_hash = {h: i for i, h in enumerate(cache.lookup(prompt + [0]).hashes)}
    memo: list[bytes] = []  # the scheduler's per-sequence memo gives the same hit
    for grown in (prompt[:40], prompt + [0], prompt + [0]):
        assert cache.lookup(grown, None, memo) == cache.lookup(grown)
    assert memo == list(cache.lookup(prompt + [0]).hashes)
    checked = 0
    for h, slot in cache.index.ckpts.items():
        if h not in by_hash:
            continue
        b = (by_hash[h] + 1) * cache.policy.unit
        dense = DenseCache(1)
        llm.model(torch.tensor(prompt[:b]), dense.begin([b]))
        for layer in llm.model.config.kda_layer_ids:
            tail, state = dense.kda[layer]
            i = cache.ckpt_pool.layer_ids.index(layer)
            assert rel_err(cache.ckpt_pool.states[i, slot], state[0]) < 1e-5
            assert rel_err(cache.ckpt_pool.tails[i, slot], tail[0]) < 1e-5
        checked += 1
    assert checked >= 4, "interval, prompt-end and chunk-interior checkpoints were compared"


def test_hit_at_last_shared_unit_and_at_junction(ckpt):
    """Request B shares all but the last 3 tokens of A's 45-token prompt: it hits at 40 (the last
    unit boundary it shares; neither a 64-token KDA chunk boundary nor a scheduler chunk
    boundary of A, whose chunks are 29 tokens). C diverges from A at 30: its MLA match (24
    tokens) has no checkpoint (a retention miss), so C checkpoints that junction while
    prefilling; D, diverging where C did, hits there."""
    llm = make(ckpt, True, max_num_batched_tokens=29)
    vocab = llm.model.config.vocab_size
    rng = random.Random(9)
    a = [rng.randrange(vocab) for _ in range(45)]
    llm.generate([a], GREEDY, use_tqdm=False)
    pc0 = dict(llm.stats()["prefix_cache"])
    b = a[:42] + [rng.randrange(vocab) for _ in range(5)]
    llm.generate([b], GREEDY, use_tqdm=False)
    pc1 = dict(llm.stats()["prefix_cache"])
    assert pc1["hits"] - pc0["hits"] == 1 and pc1["hit_tokens"] - pc0["hit_tokens"] == 40, pc1
    c = a[:30] + [rng.randrange(vocab) for _ in range(20)]
    d = a[:30] + [rng.randrange(vocab) for _ in range(20)]
    llm.generate([c], GREEDY, use_tqdm=False)
    pc2 = dict(llm.stats()["prefix_cache"])
    assert pc2["hit_tokens"] == pc1["hit_tokens"], "no checkpoint at 24 yet: C misses"
    assert pc2["retention_misses"] - pc1["retention_misses"] == 1, "3 units matched, none usable"
    llm.generate([d], GREEDY, use_tqdm=False)
    pc3 = dict(llm.stats()["prefix_cache"])
    assert pc3["hit_tokens"] - pc2["hit_tokens"] == 24
    off = make(ckpt, False)
    assert same_tokens(llm, off, [a, b, c, d])
    llm.check_integrity()


def test_simultaneous_requests_compute_the_shared_prefix_once(ckpt):
    """A (45 tokens) and B (47) share 40 tokens and arrive together. Chunks of 29: A prefills
    [0, 29) then [29, 45) while B is held; B is admitted at 40 and prefills 7 tokens. Engine
    counters: exactly the 40 shared tokens fewer computed than with the cache off, same tokens."""
    on, off = make(ckpt, True), make(ckpt, False)
    rng = random.Random(17)
    vocab = on.model.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(40)]
    a, b = shared + [rng.randrange(vocab) for _ in range(5)], shared + [rng.randrange(vocab) for _ in range(7)]
    assert same_tokens(on, off, [a, b])
    decodes = 2 * (GREEDY.max_tokens - 1)
    assert off.stats()["computed_tokens"] == 45 + 47 + decodes
    assert on.stats()["computed_tokens"] == 45 + 7 + decodes
    pc = on.stats()["prefix_cache"]
    assert (pc["hits"], pc["hit_tokens"], pc["inflight_waits"]) == (1, 40, 1), pc
    on.check_integrity()


def test_turn_end_checkpoint_serves_the_follow_up(ckpt):
    llm = make(ckpt, True)
    vocab = llm.model.config.vocab_size
    prompt = random_prompts(vocab, [13], seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    answer = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    before = dict(llm.stats()["prefix_cache"])
    follow = prompt + answer + random_prompts(vocab, [5], seed=5)[0]
    llm.generate([follow], GREEDY, use_tqdm=False)
    after = llm.stats()["prefix_cache"]
    assert after["hit_tokens"] - before["hit_tokens"] == 32, "13 + 20 tokens: the turn ended past 32"
    llm.check_integrity()


def test_logits_after_a_hit_match_the_cold_run(ckpt):
    """Top-5 logprobs (log_softmax of the logits) of every generated position agree with the
    cache off, for requests that hit."""
    on, off = make(ckpt, True, kda_checkpoint_interval=16), make(ckpt, False)
    vocab = on.model.config.vocab_size
    prompts = shared_prefix_workload(vocab, 7, [37], [3, 6, 11])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    on.generate(prompts[:1], params, use_tqdm=False)
    hot = on.generate(prompts[1:], params, use_tqdm=False)
    assert on.stats()["prefix_cache"]["hits"] >= 2
    cold = off.generate(prompts[1:], params, use_tqdm=False)
    for h, c in zip(hot, cold):
        assert h.outputs[0].token_ids == c.outputs[0].token_ids
        for lh, lc in zip(h.outputs[0].logprobs, c.outputs[0].logprobs):
            assert lh.keys() == lc.keys()
            assert max(abs(lh[t].logprob - lc[t].logprob) for t in lh) < 1e-4


def test_cache_salt_isolates_requests(ckpt):
    llm = make(ckpt, True)
    prompt = random_prompts(llm.model.config.vocab_size, [30], seed=13)[0]

    def hit_tokens(salt):
        before = llm.stats()["prefix_cache"]["hit_tokens"]
        llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, GREEDY, use_tqdm=False)
        return llm.stats()["prefix_cache"]["hit_tokens"] - before

    assert hit_tokens("alice") == 0
    assert hit_tokens("bob") == 0, "another salt never sees alice's cache"
    assert hit_tokens("alice") == 24 and hit_tokens(None) == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": 3}, use_tqdm=False)
    llm.check_integrity()
