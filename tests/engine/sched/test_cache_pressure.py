"""The prefix cache under memory pressure: admissions whose own hit competes with fresh pages for a
pool barely larger than one request, and a randomized workload (shared prefixes, staggered
arrivals, aborts, preemption) run with the cache on and off: identical greedy tokens, exact
`check_integrity()` throughout, and every page and slot free at the end."""

import random

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.config import ModelConfig
from deltaserve.tiny import make_tiny

from ..test_engine import budget_for


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=21)


def make(
    ckpt,
    prefix: bool,
    num_pages: int,
    num_ckpt_slots: int,
    page_size: int,
    unit: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> LLM:
    cfg = ModelConfig.from_pretrained(ckpt)
    live = budget_for(cfg, max_num_seqs, num_pages, page_size)
    slot = budget_for(cfg, 1, 0, page_size)
    budget = live + (num_ckpt_slots * slot if prefix else 0)
    return LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        page_size=page_size,
        kv_cache_memory=budget,
        max_model_len=max_model_len,
        progress=False,
        enable_prefix_caching=prefix,
        prefix_match_unit=unit,
        checkpoint_fraction=num_ckpt_slots * slot / budget + 1e-9 if prefix else 0.0,
    )


def assert_all_free(llm: LLM) -> None:
    llm.check_integrity()
    cache = llm.cache
    assert not cache.seqs and not llm.engine.has_unfinished()
    assert llm.reset_prefix_cache()
    llm.check_integrity()
    assert cache.mla.num_free == cache.mla.num_pages and cache.kda.num_free == cache.kda.num_slots
    if cache.ckpt_pool is not None:
        assert cache.ckpt_pool.num_free == cache.ckpt_pool.num_slots


def test_admission_keeps_what_its_own_hit_uses(ckpt):
    """C = A[:40] leaves a checkpoint at 32; A hits there and leaves units and a checkpoint at 96;
    B = A[:90] + 110 new tokens needs 13 of the 14 pages: taking them evicts LRU units and
    checkpoints, which must not include the checkpoint at 32 that B's own hit copies."""
    kw = dict(
        num_pages=14,
        num_ckpt_slots=2,
        page_size=16,
        unit=16,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        max_model_len=220,
    )
    on, off = make(ckpt, True, **kw), make(ckpt, False, **kw)
    rng = random.Random(0)
    vocab = on.model.config.vocab_size
    a = [rng.randrange(vocab) for _ in range(100)]
    b = a[:90] + [rng.randrange(vocab) for _ in range(110)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for p in (a[:40], a, b):
        assert (
            on.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids
            == off.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids
        )
        on.check_integrity()
    pc = on.stats()["prefix_cache"]
    assert pc["hits"] == 2 and pc["hit_tokens"] == 64, "A and B both hit at 32"
    assert pc["checkpoints_evicted"] > 0 and pc["units_evicted"] > 0, "B's admission evicted"
    assert_all_free(on)


def workload(vocab: int, seed: int, n: int):
    """(arrival step, request id, prompt, max_tokens, abort step or None): prompts built from a few
    shared stems (some nested), arriving in bursts; about one in eight is aborted."""
    rng = random.Random(seed)
    stems = [[rng.randrange(vocab) for _ in range(rng.randrange(6, 40))] for _ in range(4)]
    stems.append(stems[0] + [rng.randrange(vocab) for _ in range(10)])
    out, step = [], 0
    for i in range(n):
        step += rng.choice((0, 0, 0, 1, 2, 5))
        stem = rng.choice(stems)[: rng.randrange(4, 50)]
        prompt = stem + [rng.randrange(vocab) for _ in range(rng.randrange(1, 14))]
        abort = step + rng.randrange(0, 12) if rng.random() < 0.125 else None
        out.append((step, str(i), prompt[:60], rng.randrange(1, 7), abort))
    return out


def run(llm: LLM, work) -> dict[str, list[int]]:
    """Drive the engine step by step; returns the token ids of every request that finished."""
    eng, done, step = llm.engine, {}, 0
    queue = sorted(work, key=lambda w: w[0])
    aborts = sorted((w[4], w[1]) for w in work if w[4] is not None)
    while queue or eng.has_unfinished():
        while queue and queue[0][0] <= step:
            _, rid, prompt, max_tokens, _ = queue.pop(0)
            eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while aborts and aborts[0][0] <= step:
            eng.abort_request(aborts.pop(0)[1])
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
        step += 1
        if step % 5 == 0:
            llm.check_integrity()
        assert step < 5000, "the engine stopped making progress"
    return done


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_randomized_cache_pressure(ckpt, seed):
    """~100 requests per seed on a pool a few pages larger than one request (60 + 6 tokens = 17
    pages of 4): preemption, eviction of units and checkpoints, aborts mid-prefill and mid-decode."""
    kw = dict(
        num_pages=21, num_ckpt_slots=3, page_size=4, unit=4, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=72
    )
    on, off = make(ckpt, True, **kw), make(ckpt, False, **kw)
    work = workload(on.model.config.vocab_size, seed, 100)
    got, want = run(on, work), run(off, work)
    both = got.keys() & want.keys()
    assert len(both) >= 80
    assert {k: got[k] for k in both} == {k: want[k] for k in both}
    stats, pc = on.stats(), on.stats()["prefix_cache"]
    assert stats["preemptions"] > 0 and stats["requests_aborted"] > 0, stats
    assert pc["hits"] > 0 and pc["checkpoints_evicted"] > 0 and pc["units_evicted"] > 0, pc
    assert pc["restore_refused"] == 0
    assert_all_free(on)
    assert_all_free(off)


def _run(llm: LLM, limit: int = 400) -> bool:
    for _ in range(limit):
        if not llm.engine.has_unfinished():
            return True
        llm.engine.step()
        llm.check_integrity()
    return False


GREEDY1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def test_a_recomputed_prefix_under_cached_ancestors_does_not_preempt_itself_forever(ckpt):
    """A's units stay cached without a checkpoint (B took the only slot); C = A recomputes from 0
    on its own pages and re-registers A's evicted deep units under A's cached shallow ones, which
    then cannot be evicted while C runs. Counting them as reclaimable made every admission flush
    the cache and C preempt itself forever, with D starving behind it."""
    llm = make(ckpt, True, 10, 1, 16, 16, 2, 24, 128)
    core, a = llm.engine, list(range(100, 227))
    core.add_request("A", a, GREEDY1)
    assert _run(llm)
    core.add_request("B", list(range(600, 632)), GREEDY1)
    assert _run(llm)
    core.add_request("C", a, GREEDY1)
    core.add_request("D", [5, 6, 7], GREEDY1)
    assert _run(llm), f"stuck after {core.scheduler.num_preemptions} preemptions"
    assert_all_free(llm)


def test_reset_prefix_cache_evicts_what_no_running_request_shares(ckpt):
    llm = make(ckpt, True, 40, 4, 16, 16, 4, 512, 128)
    core = llm.engine
    core.add_request("old", list(range(100, 164)), GREEDY1)
    assert _run(llm)
    core.add_request("live", list(range(900, 920)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    core.step()
    assert llm.cache.prefix_stats()["cached_units"] >= 4
    llm.cache.reset_prefix_cache()
    llm.check_integrity()
    assert llm.cache.index.reclaimable_pages() == 0  # all that is left is what "live" shares
    assert llm.cache.prefix_stats()["cached_units"] <= 1
