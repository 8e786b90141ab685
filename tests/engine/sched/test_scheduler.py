"""`Scheduler` against exact per-step traces: a real `CacheManager` over tiny pools, no model.

`Sim.step` applies what `EngineCore.step` would: export plans and commits when prefix caching is
on, `num_computed += num_new`, one fake token for each sequence whose chunk completes it, and
removal at `max_tokens`. A trace entry is `(request_id, num_new)`.
"""

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.cache import CacheManager, KdaStatePool, MlaPagePool
from deltaserve.cache.checkpoint_policy import CheckpointPolicy
from deltaserve.engine.request.sequence import SeqStatus, Sequence
from deltaserve.engine.sched.scheduler import Scheduler


def _slots(n: int) -> KdaStatePool:
    return KdaStatePool([1, 3], n, tail_shape=(1, 2), state_shape=(1, 2, 2), tail_dtype=torch.float32)


class Sim:
    def __init__(self, num_pages, page_size=2, num_slots=4, max_num_seqs=4, budget=8, unit=None):
        mla = MlaPagePool([0, 2], num_pages, page_size, row_dim=2, dtype=torch.float32)
        ckpt, policy = (_slots(4), CheckpointPolicy(unit)) if unit else (None, None)
        self.cache = CacheManager(mla, _slots(num_slots), ckpt, policy)
        self.sched = Scheduler(self.cache, max_num_seqs, budget)
        self.next_id = 0

    def add(self, name: str, prompt, max_tokens: int = 100) -> Sequence:
        ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
        seq = Sequence(self.next_id, name, 0, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.next_id += 1
        self.sched.add(seq)
        return seq

    def apply(self, scheduled) -> list[tuple[str, int]]:
        cache = self.cache
        done = [s.completes for s in scheduled]
        if cache.prefix_enabled:
            for s in scheduled:
                cache.plan_exports(s.seq.seq_id, s.seq.num_computed, s.num_new)
        for s, completes in zip(scheduled, done):
            s.seq.num_computed += s.num_new
            if cache.prefix_enabled:
                cache.commit(s.seq.seq_id, s.seq.all_ids(), s.seq.num_computed)
            if completes:
                s.seq.output_ids.append(1000 + len(s.seq.output_ids))
                if len(s.seq.output_ids) == s.seq.params.max_tokens:
                    s.seq.status, s.seq.finish_reason = SeqStatus.FINISHED, "length"
                    self.sched.remove(s.seq)
        cache.check_integrity()
        return [(s.seq.request_id, s.num_new) for s in scheduled]

    def step(self) -> list[tuple[str, int]]:
        return self.apply(self.sched.schedule())

    def run(self) -> list[list[tuple[str, int]]]:
        trace = []
        while self.sched.has_work():
            trace.append(self.step())
            assert len(trace) < 50, "no progress"
        assert not self.cache.seqs and self.cache.kda.num_used == 0
        return trace

    def names(self, queue) -> list[str]:
        return [s.request_id for s in queue]


@pytest.mark.parametrize(
    "budget, want",
    [
        (8, [[("a", 8)], [("a", 2), ("b", 6)], [("a", 1), ("b", 1), ("c", 3)], [("b", 1), ("c", 1)]]),
        (5, [[("a", 5)], [("a", 5)], [("a", 1), ("b", 4)], [("b", 3), ("c", 2)], [("b", 1), ("c", 1)], [("c", 1)]]),
    ],
)
def test_chunked_prefill_trace(budget, want):
    """Running sequences first (oldest first), then admission into the leftover budget; a prefill
    is split across steps, a decode takes one token."""
    sim = Sim(num_pages=32, page_size=4, budget=budget)
    for name, n in zip("abc", (10, 7, 3)):
        sim.add(name, n, max_tokens=2)
    assert sim.run() == want


def test_max_num_seqs_caps_running():
    sim = Sim(num_pages=32, max_num_seqs=2, budget=100)
    for name in "abc":
        sim.add(name, 2, max_tokens=2)
    assert sim.step() == [("a", 2), ("b", 2)]
    assert sim.names(sim.sched.running) == ["a", "b"] and sim.names(sim.sched.waiting) == ["c"]
    assert sim.run() == [[("a", 1), ("b", 1)], [("c", 2)], [("c", 1)]]


def test_fifo_admission_short_request_never_overtakes():
    """`a` needs 3 pages while 2 are free; `b` (1 page) would fit but waits behind it, and the
    failed admission takes nothing."""
    sim = Sim(num_pages=4, budget=100)
    x = sim.add("x", 4, max_tokens=2)
    a, b = sim.add("a", 6), sim.add("b", 2)
    assert sim.step() == [("x", 4)]
    assert sim.names(sim.sched.waiting) == ["a", "b"] and a.num_computed == b.num_computed == 0
    assert set(sim.cache.seqs) == {x.seq_id}
    assert (sim.cache.mla.num_used, sim.cache.kda.num_used) == (2, 1)
    assert sim.step() == [("x", 1)], "x grows to 3 pages: 1 free, still short for a"
    assert sim.names(sim.sched.waiting) == ["a", "b"]
    assert sim.step() == [("a", 6), ("b", 2)]


def test_admission_waits_for_a_slot():
    sim = Sim(num_pages=32, num_slots=1, budget=100)
    sim.add("x", 2, max_tokens=2)
    sim.add("a", 2, max_tokens=1)
    assert sim.step() == [("x", 2)]
    assert (sim.cache.mla.num_used, sim.cache.kda.num_used) == (1, 1)
    assert sim.names(sim.sched.waiting) == ["a"]
    assert sim.run() == [[("x", 1)], [("a", 2)]]


def test_preemption_victim_is_newest_and_oldest_progresses():
    """4 pages of 2 tokens. Step 2: `b` needs a page, `c` (newest) is preempted. Step 4: `a`
    needs a page, `b` is preempted and goes ahead of `c`. Preempted sequences keep their
    outputs and re-prefill prompt plus outputs."""
    sim = Sim(num_pages=4, budget=8)
    a, b, c = (sim.add(name, 2, max_tokens=4) for name in "abc")
    assert sim.step() == [("a", 2), ("b", 2), ("c", 2)]
    assert sim.cache.mla.num_free == 1
    assert sim.step() == [("a", 1), ("b", 1)]
    assert sim.names(sim.sched.waiting) == ["c"] and sim.names(sim.sched.running) == ["a", "b"]
    assert (c.num_computed, c.output_ids, c.status) == (0, [1000], SeqStatus.WAITING)
    assert c.seq_id not in sim.cache.seqs and sim.sched.num_preemptions == 1
    assert sim.step() == [("a", 1), ("b", 1)], "c needs 2 pages, none free"
    assert sim.step() == [("a", 1)]
    assert sim.names(sim.sched.waiting) == ["b", "c"] and sim.sched.num_preemptions == 2
    assert (b.num_computed, len(b.output_ids)) == (0, 3) and a.finished
    assert sim.run() == [[("b", 5)], [("c", 3)], [("c", 1)], [("c", 1)]]
    assert sim.sched.num_preemptions == 2
    assert [s.output_ids for s in (a, b, c)] == [[1000, 1001, 1002, 1003]] * 3


def test_no_admission_in_a_step_that_preempted():
    """Step 4: `b` must grow past its page with none free, so it (the newest) is preempted; the
    freed page and the budget left would re-admit its first chunk, but not in that step."""
    sim = Sim(num_pages=3, page_size=4, budget=4)
    a, b = sim.add("a", 4), sim.add("b", 4)
    assert [sim.step() for _ in range(3)] == [[("a", 4)], [("a", 1), ("b", 3)], [("a", 1), ("b", 1)]]
    assert sim.step() == [("a", 1)]
    assert sim.sched.num_preemptions == 1 and sim.names(sim.sched.waiting) == ["b"]
    assert sim.cache.mla.num_free == 1 and sim.cache.mla.pages_for(min(b.num_tokens, 3)) == 1
    assert b.num_computed == 0 and b.num_tokens == 5
    assert sim.step() == [("a", 1), ("b", 3)]
    assert sim.step() == [("a", 1)], "a needs a 3rd page: b is preempted again"
    assert sim.sched.num_preemptions == 2 and a.num_computed == 9


def test_preempting_self_stops_the_running_pass():
    """When the sequence that cannot grow is itself the newest it is preempted; older ones already
    scheduled keep their chunks."""
    sim = Sim(num_pages=3, budget=8)
    a, b = sim.add("a", 1), sim.add("b", 4)
    assert sim.step() == [("a", 1), ("b", 4)]
    assert sim.step() == [("a", 1)], "a fits its page; b needs a 3rd page, none free"
    assert sim.names(sim.sched.running) == ["a"] and sim.names(sim.sched.waiting) == ["b"]
    assert (a.num_computed, b.num_computed, sim.sched.num_preemptions) == (2, 0, 1)


def test_remove_waiting_and_running():
    sim = Sim(num_pages=8, budget=2)
    a, b = sim.add("a", 2), sim.add("b", 2)
    assert sim.step() == [("a", 2)]
    sim.sched.remove(b)
    sim.sched.remove(a)
    sim.cache.check_integrity()
    assert not sim.sched.has_work() and sim.cache.mla.num_used == sim.cache.kda.num_used == 0


def test_rejects_non_positive_limits():
    cache = Sim(num_pages=1).cache
    for seqs, tokens in ((0, 8), (4, 0)):
        with pytest.raises(ValueError):
            Scheduler(cache, seqs, tokens)


def test_prefix_hit_starts_at_hit_length():
    """Unit 4, pages of 2. `a` (10 tokens) registers units [0, 8) and a checkpoint at 8; `b`
    shares those 8 tokens, is admitted at 8 on the 4 cached pages and chunks from there; `c`
    shares only unit 0, which has no checkpoint, so it starts from 0."""
    sim = Sim(num_pages=16, budget=4, unit=4)
    prefix = list(range(1, 9))
    sim.add("a", prefix + [9, 10], max_tokens=1)
    assert sim.run() == [[("a", 4)], [("a", 4)], [("a", 2)]]
    cached = sim.cache.index.pages_of(list(sim.cache.index.units), 2)
    assert len(cached) == 4 and sim.cache.mla.num_used == 4
    b = sim.add("b", prefix + [50, 51, 52, 53, 54, 55], max_tokens=1)
    scheduled = sim.sched.schedule()
    assert [(s.seq.request_id, s.seq.num_computed, s.num_new) for s in scheduled] == [("b", 8, 4)]
    assert sim.cache.seqs[b.seq_id].pages[:4] == cached and len(sim.cache.seqs[b.seq_id].pages) == 6
    assert sim.apply(scheduled) == [("b", 4)]
    assert sim.run() == [[("b", 2)]]
    c = sim.add("c", prefix[:4] + [60, 61, 62], max_tokens=1)
    assert sim.step() == [("c", 4)] and c.num_computed == 4
    stats = sim.cache.prefix_stats()
    assert {k: stats[k] for k in ("queries", "hits", "hit_tokens", "retention_misses")} == {
        "queries": 3,
        "hits": 1,
        "hit_tokens": 8,
        "retention_misses": 1,
    }
