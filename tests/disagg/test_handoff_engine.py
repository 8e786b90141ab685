"""The engine and cache sides of a handoff, without servers or a transfer engine: the regions a
prefill engine parks are copied byte for byte into a decode engine's reservation (what the
transfer engine does), fp32, both families. The decode engine then gives the colocated greedy
tokens; its own prefix cache shortens later transfers; preempted, aborted and cancelled
reservations leave exact pools; a parked prefill is never sampled and feeds the prefix cache."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve.cache.handoff import digest, expected_bytes, mla_regions, pool_tensors, region_digests
from deltaserve.cache.mla_pool import MlaPagePool
from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.engine.sched import handoff
from deltaserve.tiny import make_tiny

from .pd_fixtures import make_llm

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_mla_regions_split_at_pages():
    pool = MlaPagePool([3, 7], num_pages=8, page_size=4, row_dim=5, dtype=torch.float32)
    regs = mla_regions(pool, [6, 2, 5], 2, 9)  # positions 2..8: page 6 rows 2-3, page 2 all, page 5 row 0
    row = 5 * 4
    want = [(6 * 4 + 2, 2), (2 * 4, 4), (5 * 4, 1)]
    assert [(r.layer, r.offset, r.length) for r in regs] == [
        (i, (i * 32 + a) * row, n * row) for i in range(2) for a, n in want
    ]


def test_digest_in_place_equals_the_copied_bytes():
    """Host pools hash their regions in place; device pools copy each layer's regions to the host
    in one transfer first: the same bytes, the same digest (both branches forced here)."""
    pool = torch.arange(64, dtype=torch.uint8)
    parts = [pool[3:9], pool[20:21], pool[40:64]]
    assert digest(parts) == digest(parts, copy=False) == digest(parts, copy=True)
    assert digest(parts, copy=True) != digest(parts[::-1], copy=True)
    assert digest([]) == digest([], copy=True)


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def engines(request, tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("ho") / request.param, request.param, "tiny", seed=4)
    return make_llm(ckpt), make_llm(ckpt), make_llm(ckpt)


def _run(core, max_steps: int = 500):
    out = []
    for _ in range(max_steps):
        if not core.has_unfinished():
            return out
        out += core.step()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def _handoff(p, d, rid: str, prompt: list[int]) -> tuple[handoff.Reservation, int]:
    """Prefill on `p`, copy into a reservation on `d`; returns it and the bytes copied."""
    p.engine.add_request(rid, prompt[:-1], SamplingParams(max_tokens=1), prefill_only=True)
    done = _run(p.engine)
    assert [o.outputs[0].finish_reason for o in done] == ["prefilled"] and done[0].outputs[0].token_ids == []
    res = handoff.reserve(d.engine, prompt)
    src = handoff.parked_regions(p.engine, rid, res.start)
    assert [(r.tensor, r.layer, r.length) for r in src] == [(r.tensor, r.layer, r.length) for r in res.regions]
    a, b = pool_tensors(p.cache.mla, p.cache.kda), pool_tensors(d.cache.mla, d.cache.kda)
    for s, r in zip(src, res.regions):
        b[r.tensor].view(-1).view(torch.uint8)[r.offset : r.offset + r.length] = (
            a[s.tensor].view(-1).view(torch.uint8)[s.offset : s.offset + s.length]
        )
    assert region_digests(a, src) == region_digests(b, list(res.regions))
    assert handoff.release_parked(p.engine, rid) and not handoff.release_parked(p.engine, rid)
    return res, sum(r.length for r in src)


def test_handoff_equals_colocated_and_decode_cache_shortens_it(engines):
    p, d, ref = engines
    rng = random.Random(3)
    base = [rng.randrange(10, 1700) for _ in range(90)]
    history = base
    for turn in range(3):
        want = ref.generate([{"prompt_token_ids": history}], GREEDY)[0].outputs[0]
        res, moved = _handoff(p, d, f"t{turn}", history)
        assert moved == expected_bytes(d.cache, len(history) - 1 - res.start)
        assert (res.start == 0) == (turn == 0) and res.start % 16 == 0
        d.engine.add_request(f"t{turn}", history, GREEDY, received=res.seq_id)
        got = _run(d.engine)[0].outputs[0]
        assert got.token_ids == want.token_ids
        history = history + list(got.token_ids) + [rng.randrange(10, 1700) for _ in range(25)]
    assert d.cache.counters["received"] == 3 and d.cache.counters["received_hit_tokens"] > 0
    for llm in (p, d):
        llm.cache.check_integrity()
        assert llm.cache.kda.num_used == 0 and not llm.engine.parked


def test_cancelled_aborted_and_preempted_reservations(engines):
    p, d, ref = engines
    prompt = list(range(200, 300))
    want = ref.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids
    res = handoff.reserve(d.engine, prompt)
    handoff.cancel(d.engine, res.seq_id)
    res, _ = _handoff(p, d, "ab", prompt)
    d.engine.add_request("ab", prompt, GREEDY, received=res.seq_id)
    d.engine.abort_request("ab")
    res, _ = _handoff(p, d, "pre", prompt)
    d.engine.add_request("pre", prompt, GREEDY, received=res.seq_id)
    seq = d.engine.requests["pre"].seqs[0]
    d.engine.step()
    d.engine.scheduler._preempt(seq)  # recomputed from scratch here: the same tokens
    assert not seq.preadmitted and seq.num_computed == 0
    assert _run(d.engine)[0].outputs[0].token_ids == want
    d.cache.check_integrity()
    assert d.cache.kda.num_used == 0


def test_a_parked_prefill_feeds_the_prefix_cache(engines):
    p, _, _ = engines
    prompt = list(range(500, 600))
    p.engine.add_request("park", prompt, SamplingParams(max_tokens=1), prefill_only=True)
    _run(p.engine)
    assert "park" in p.engine.parked and p.engine.stats()["generated_tokens"] == 0
    with pytest.raises(ValueError):
        handoff.parked_regions(p.engine, "park", 5)  # not a page boundary
    handoff.release_parked(p.engine, "park")
    assert p.cache.lookup(prompt + [1]).length == len(prompt) // 16 * 16


def test_coalesce_merges_only_runs_adjacent_on_both_sides():
    from deltaserve.parallel.kv_transfer import coalesce

    remote = [(100, 10), (110, 5), (115, 5), (200, 4)]
    local = [(1000), (1010), (2000), (2005)]
    assert coalesce(remote, local) == ([100, 115, 200], [1000, 2000, 2005], [15, 5, 4])


def test_received_requests_pass_a_head_waiting_for_their_slots(engines):
    """Every live slot held by reservations, a plain request queued first: it waits for a slot
    the received ones hold, so they must run first (admission would otherwise deadlock)."""
    p, d, ref = engines
    prompts = [list(range(100 + 40 * i, 160 + 40 * i)) for i in range(d.cache.kda.num_slots)]
    reserved = [_handoff(p, d, f"r{i}", q)[0] for i, q in enumerate(prompts)]
    assert d.cache.kda.num_free == 0
    d.engine.add_request("head", list(range(900, 950)), GREEDY)
    for i, (q, res) in enumerate(zip(prompts, reserved)):
        d.engine.add_request(f"r{i}", q, GREEDY, received=res.seq_id)
    done = {o.request_id: o.outputs[0].token_ids for o in _run(d.engine)}
    want = ref.generate([{"prompt_token_ids": q} for q in prompts + [list(range(900, 950))]], GREEDY)
    assert [done[f"r{i}"] for i in range(len(prompts))] + [done["head"]] == [o.outputs[0].token_ids for o in want]
    d.cache.check_integrity()


def test_a_reservation_waits_behind_requests_queued_before_it(engines):
    """A decode instance's local request queued before a reservation keeps its place: the
    reservation is made once that request is admitted, not before (it would take the slot or pages
    the request waits for); requests queued after the reservation began waiting do not hold it."""
    from deltaserve.disagg.decode import Ask, reserve_behind

    p, d, ref = engines
    core = d.engine
    core.add_request("head", list(range(900, 950)), GREEDY)
    marker = core._next_seq
    prompt = list(range(300, 372))
    assert reserve_behind(core, Ask(prompt), marker) is None  # "head" arrived first and still waits
    core.step()  # admits it
    assert not core.scheduler.waiting
    core.add_request("later", list(range(500, 530)), GREEDY)  # queued after the reservation's mark
    res = reserve_behind(core, Ask(prompt), marker)
    assert res is not None and res.stop == len(prompt) - 1
    handoff.cancel(core, res.seq_id)
    done = {o.request_id: o.outputs[0].token_ids for o in _run(core)}
    want = ref.generate([{"prompt_token_ids": list(range(900, 950))}], GREEDY)[0].outputs[0].token_ids
    assert done["head"] == want and set(done) == {"head", "later"}
    d.cache.check_integrity()


def test_a_reservation_holds_no_request_and_is_claimed_once(engines):
    """A pending reservation never prefills its span, so a request sharing its prefix does not wait
    on it; a reservation is claimed by one request only, and a running sequence is none."""
    _, d, _ = engines
    core, prompt = d.engine, list(range(100, 200))
    res = handoff.reserve(core, prompt)
    waits = d.cache.counters["inflight_waits"]
    core.add_request("q", prompt[:70] + [7, 8, 9], SamplingParams(max_tokens=2, temperature=0))
    for _ in range(20):
        if "q" not in core.requests:
            break
        core.step()
    assert "q" not in core.requests and d.cache.counters["inflight_waits"] == waits
    core.add_request("a", prompt, SamplingParams(max_tokens=2, temperature=0), received=res.seq_id)
    with pytest.raises(InvalidRequestError, match="no unclaimed handoff reservation"):
        core.add_request("b", prompt, SamplingParams(max_tokens=2, temperature=0), received=res.seq_id)
    handoff.cancel(core, res.seq_id)  # claimed: the request owns it now
    while core.has_unfinished():
        core.step()
    d.check_integrity()
    assert not d.cache.seqs
