"""Prefix sharing within a step: a waiting request whose prefix an older running request is still
prefilling is held until that prefix is cached, then admitted with the hit. Exact per-step traces
over a real `CacheManager` (see `Sim` in test_scheduler.py): unit 4, pages of 2 tokens."""

import pytest

from deltaserve.cache.checkpoint_policy import CheckpointPolicy

from .test_scheduler import Sim

PREFIX = list(range(1, 9))
A = PREFIX + [9, 10]
B = PREFIX + [50, 51, 52, 53, 54, 55]


def computed(trace, name: str) -> int:
    return sum(n for step in trace for r, n in step if r == name)


def test_held_then_admitted_with_the_hit_while_others_proceed():
    """`b` shares `a`'s 8-token prefix: held in step 1 (`a` checkpoints the junction at 8 in the
    same pass), admitted in step 2 at 8. Unrelated `c`, behind `b`, takes the budget `b` left;
    `b` keeps its place. Without the cache `b` prefills all 14 tokens in steps 1-2."""
    sim = Sim(num_pages=32, budget=16, unit=4)
    a, b = sim.add("a", A, max_tokens=2), sim.add("b", B, max_tokens=2)
    sim.add("c", [100, 101, 102, 103, 104, 105], max_tokens=2)
    assert sim.step() == [("a", 10), ("c", 6)]
    assert sim.names(sim.sched.waiting) == ["b"] and b.seq_id not in sim.cache.seqs
    assert sim.cache.counters["inflight_waits"] == 1
    scheduled = sim.sched.schedule()
    assert [(s.seq.request_id, s.seq.num_computed, s.num_new) for s in scheduled] == [
        ("a", 10, 1),
        ("c", 6, 1),
        ("b", 8, 6),
    ]
    assert sim.cache.seqs[b.seq_id].pages[:4] == sim.cache.seqs[a.seq_id].pages[:4], "shared, not copied"
    sim.apply(scheduled)
    rest = sim.run()
    assert rest == [[("b", 1)]] and computed([[("b", 6)]] + rest, "b") == 7
    stats = sim.cache.prefix_stats()
    assert {k: stats[k] for k in ("queries", "hits", "hit_tokens", "inflight_waits")} == {
        "queries": 3,
        "hits": 1,
        "hit_tokens": 8,
        "inflight_waits": 1,
    }

    off = Sim(num_pages=32, budget=16)
    for name, prompt in (("a", A), ("b", B), ("c", [100, 101, 102, 103, 104, 105])):
        off.add(name, prompt, max_tokens=2)
    trace = off.run()
    assert trace[0] == [("a", 10), ("b", 6)] and computed(trace, "b") == 15


@pytest.mark.parametrize(
    "b_prompt, unit, first",
    [
        ([1, 2, 3, 9, 7, 7], 4, [("a", 6)]),  # one shared unit: held
        ([1, 2, 3, 7, 7, 7], 4, [("a", 6), ("b", 6)]),  # 3 shared tokens < unit: nothing to gain
        ([1, 2, 3, 9, 7, 7], None, [("a", 6), ("b", 6)]),  # prefix caching off: never held
    ],
)
def test_holds_only_for_at_least_one_match_unit(b_prompt, unit, first):
    sim = Sim(num_pages=32, budget=16, unit=unit)
    sim.add("a", [1, 2, 3, 9, 9, 9], max_tokens=1)
    sim.add("b", b_prompt, max_tokens=1)
    assert sim.step() == first
    sim.run()


@pytest.mark.parametrize(
    "committed, rest",
    [
        (False, [[("b", 14)]]),  # the step that would have cached the prefix is discarded
        (True, [[("b", 6)]]),  # aborted after its step: what it cached stays
    ],
)
def test_abort_of_the_holder_releases_the_hold(committed, rest):
    sim = Sim(num_pages=32, budget=16, unit=4)
    a = sim.add("a", A, max_tokens=3)
    sim.add("b", B, max_tokens=1)
    scheduled = sim.sched.schedule()
    assert [(s.seq.request_id, s.num_new) for s in scheduled] == [("a", 10)]
    assert sim.names(sim.sched.waiting) == ["b"]
    if committed:
        sim.apply(scheduled)
    sim.sched.remove(a)
    sim.cache.check_integrity()
    assert sim.run() == rest
    assert sim.cache.prefix_stats()["hit_tokens"] == (8 if committed else 0)


def test_preemption_of_the_holder_does_not_strand_the_held():
    """7 pages. Step 1: `b` is held on `a`, which checkpoints the shared 8 tokens. Step 2: `x`
    grows, `a` (newest) is preempted; the failed growth could not have made room by eviction, so
    it evicted nothing and `a`'s checkpoint survives; a preempting step admits nothing. Step 3: `a`
    is re-admitted with that 8-token hit and computes only its 3-token tail (prompt and first
    output). Step 4: `b` is admitted with the same hit and computes only its 6-token tail."""
    sim = Sim(num_pages=7, budget=16, unit=4)
    sim.add("x", [200, 201], max_tokens=2)
    sim.add("a", A, max_tokens=2)
    sim.add("b", B, max_tokens=1)
    assert sim.step() == [("x", 2), ("a", 10)]
    assert sim.names(sim.sched.waiting) == ["b"]
    assert sim.step() == [("x", 1)]
    assert sim.names(sim.sched.waiting) == ["a", "b"] and sim.sched.num_preemptions == 1
    assert len(sim.cache.index.ckpts) == 1 and sim.cache.index.evicted_checkpoints == 0
    assert sim.step() == [("a", 3)] and sim.names(sim.sched.waiting) == ["b"]
    assert sim.run() == [[("b", 6)]]
    stats = sim.cache.prefix_stats()
    assert (stats["hit_tokens"], stats["inflight_waits"]) == (16, 1)


def test_inflight_hit_boundaries():
    """Holds target a sequence older than the waiting one, past what it has computed; without the
    junction policy only a boundary it checkpoints anyway counts."""
    sim = Sim(num_pages=32, unit=4)
    cache = sim.cache
    holder = list(range(1, 13))
    waiting = cache.lookup(holder[:8] + [70, 71])
    assert cache.admit(5, 12, cache.lookup(holder), 12)
    assert cache.inflight_hit(waiting, older_than=5) == 0, "only older sequences are waited for"
    assert cache.inflight_hit(waiting, older_than=6) == 8 and 8 in cache.seqs[5].wanted
    cache.free(5)
    cache.policy = CheckpointPolicy(4, junction=False)
    assert cache.admit(5, 12, cache.lookup(holder), 12)
    assert cache.seqs[5].wanted == {12} and cache.inflight_hit(waiting, 6) == 0
    cache.free(5)
    cache.policy = CheckpointPolicy(4, junction=False, interval=4)
    assert cache.admit(5, 12, cache.lookup(holder), 12)
    assert cache.inflight_hit(waiting, 6) == 8
    cache.seqs[5].hashes = list(cache.seqs[5].chain[:2])  # its prefill has computed [0, 8)
    assert cache.inflight_hit(waiting, 6) == 0
    cache.free(5)
    cache.check_integrity()
