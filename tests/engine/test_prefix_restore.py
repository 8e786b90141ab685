"""Fail-closed restores: a KDA checkpoint is used only if its tag (prefix hash, token count,
producer fingerprint) matches the restoring request; otherwise it is refused, counted, dropped
and the request runs as a miss, with the same tokens as the cache off."""

import dataclasses
import random

import pytest
import torch

from deltaserve.cache.checkpoint_tag import CheckpointTag, state_fingerprint
from deltaserve.cache.kda_pool import KdaStatePool

from .test_prefix_cache import GREEDY, make, tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from deltaserve.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=21)


def stored(llm, prompt):
    """Run `prompt`; return (hash, slot) of the checkpoint at its last unit boundary."""
    llm.generate([prompt], GREEDY, use_tqdm=False)
    hit = llm.cache.lookup(prompt + [0])
    h = hit.hashes[hit.k_hit - 1]
    assert hit.k_hit * llm.cache.policy.unit == len(prompt) // 8 * 8
    return h, llm.cache.index.ckpts[h]


def prompts(vocab, seed=5):
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(30)]
    return base, base + [rng.randrange(vocab) for _ in range(7)]


def test_tags_name_what_each_checkpoint_holds(ckpt):
    llm = make(ckpt, True)
    base, follow = prompts(llm.model.config.vocab_size)
    h, slot = stored(llm, base)
    assert llm.cache.ckpt_pool.tags[slot] == CheckpointTag(h, 24, llm.cache.fingerprint)
    before = llm.stats()["prefix_cache"]["hit_tokens"]
    llm.generate([follow], GREEDY, use_tqdm=False)
    pc = llm.stats()["prefix_cache"]
    assert pc["hit_tokens"] - before == 24 and pc["restore_refused"] == 0


@pytest.mark.parametrize("field", ["prefix_hash", "num_tokens", "fingerprint", "missing"])
def test_corrupted_tag_is_refused_and_treated_as_a_miss(ckpt, field):
    on, off = make(ckpt, True), make(ckpt, False)
    base, follow = prompts(on.model.config.vocab_size)
    h, slot = stored(on, base)
    pool = on.cache.ckpt_pool
    tag = pool.tags[slot]
    bad = {"prefix_hash": bytes(32), "num_tokens": 16, "fingerprint": b"other"}
    pool.tags[slot] = None if field == "missing" else dataclasses.replace(tag, **{field: bad[field]})
    before = dict(on.stats()["prefix_cache"])
    assert tokens(on.generate([follow], GREEDY, use_tqdm=False)) == tokens(
        off.generate([follow], GREEDY, use_tqdm=False)
    )
    pc = on.stats()["prefix_cache"]
    assert pc["restore_refused"] - before["restore_refused"] == 1
    assert pc["hits"] == before["hits"], "no other checkpoint on the path: a cold prefill"
    assert pc["hit_tokens"] == before["hit_tokens"]
    assert on.cache.ckpt_pool.tags[on.cache.index.ckpts[h]] == tag, "re-stored with a good tag"
    on.check_integrity()


def test_swapped_states_are_never_restored(ckpt):
    """The index points each boundary at the other prompt's state (what a stale reference after a
    failed transfer looks like): both restores are refused and outputs stay exact."""
    on, off = make(ckpt, True), make(ckpt, False)
    vocab = on.model.config.vocab_size
    a, a2 = prompts(vocab, 1)
    b, b2 = prompts(vocab, 2)
    ha, sa = stored(on, a)
    hb, sb = stored(on, b)
    idx = on.cache.index
    idx.ckpts[ha], idx.ckpts[hb] = sb, sa
    on.check_integrity()
    assert tokens(on.generate([a2, b2], GREEDY, use_tqdm=False)) == tokens(
        off.generate([a2, b2], GREEDY, use_tqdm=False)
    )
    assert on.stats()["prefix_cache"]["restore_refused"] == 2
    on.check_integrity()


def test_another_producer_fingerprint_refuses_every_state(ckpt):
    """States written under one fingerprint (model, dtypes, layout, kernel path) are refused
    under another, then re-stored under the new one and hit again."""
    on, off = make(ckpt, True), make(ckpt, False)
    base, follow = prompts(on.model.config.vocab_size)
    stored(on, base)
    cache = on.cache
    other = state_fingerprint(cache.model_id, cache.ckpt_pool.tails, cache.ckpt_pool.states, "triton")
    assert other != cache.fingerprint
    cache.fingerprint = other
    before = dict(on.stats()["prefix_cache"])
    assert tokens(on.generate([follow], GREEDY, use_tqdm=False)) == tokens(
        off.generate([follow], GREEDY, use_tqdm=False)
    )
    mid = dict(on.stats()["prefix_cache"])
    assert mid["restore_refused"] - before["restore_refused"] >= 1 and mid["hits"] == before["hits"]
    assert tokens(on.generate([follow], GREEDY, use_tqdm=False)) == tokens(
        off.generate([follow], GREEDY, use_tqdm=False)
    )
    after = on.stats()["prefix_cache"]
    assert after["hits"] - mid["hits"] == 1 and after["restore_refused"] == mid["restore_refused"]
    on.check_integrity()


def test_fingerprint_covers_model_dtype_layout_and_kernel():
    pool = KdaStatePool([1, 3], 2, (3, 8), (2, 4, 4), torch.float32)
    half = KdaStatePool([1, 3], 2, (3, 8), (2, 4, 4), torch.bfloat16)
    wide = KdaStatePool([1, 3], 2, (3, 8), (2, 4, 8), torch.float32)
    more = KdaStatePool([1, 3], 5, (3, 8), (2, 4, 4), torch.float32)
    fp = state_fingerprint("m", pool.tails, pool.states, "torch")
    assert fp == state_fingerprint("m", more.tails, more.states, "torch"), "slot count is not identity"
    for other in (
        state_fingerprint("n", pool.tails, pool.states, "torch"),
        state_fingerprint("m", half.tails, half.states, "torch"),
        state_fingerprint("m", wide.tails, wide.states, "torch"),
        state_fingerprint("m", pool.tails, pool.states, "cpu-native"),
    ):
        assert other != fp


def test_released_slots_lose_their_tag():
    pool = KdaStatePool([1], 1, (1, 2), (1, 2, 2), torch.float32)
    s = pool.allocate()
    pool.tags[s] = CheckpointTag(b"h", 4, b"f")
    pool.release(s)
    assert pool.tags[s] is None
    assert pool.allocate() == s and pool.tags[s] is None
