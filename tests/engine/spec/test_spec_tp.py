"""Speculative decoding over two tensor-parallel processes: the worker keeps each verify step's
batch and folds the verified tokens on the `Fold` that follows, so the tokens equal one process's
without speculation and every rank's checkpoints equal one speculating process's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.tiny import PRESETS

from ...parallel.engine_fixtures import WIDE, make_llm
from .helpers import copy_prompts, loopy_tiny

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        m.setitem(PRESETS, ("kimi_k3", "tp"), dataclasses.replace(PRESETS[("kimi_k3", "tiny")], **WIDE))
        return loopy_tiny(tmp_path_factory.mktemp("spec_tp"), "kimi_k3", preset="tp")


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A smaller K3 (the tiny preset, another seed) with the same vocabulary and tokenizer."""
    return loopy_tiny(tmp_path_factory.mktemp("spec_tp_draft"), "kimi_k3", seed=5)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_two_ranks_speculate_like_one_process(ckpt, drafter, method):
    """draft_model: a smaller checkpoint drafts, loaded whole on rank 0 (the ranks only verify)."""
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}  # drafts every step: some rejected
    if method == "draft_model":
        spec["model"] = str(drafter)
    kw = dict(enable_prefix_caching=True, max_num_seqs=4, max_model_len=128, page_size=4, prefix_match_unit=8)
    prompts = copy_prompts(2000, [9, 21, 14], seed=4)
    with make_llm(ckpt, **kw) as off:
        want = [o.outputs[0].token_ids for o in off.generate(prompts, PARAMS, use_tqdm=False)]
    with make_llm(ckpt, speculative_config=spec, **kw) as one:
        one.generate(prompts, PARAMS, use_tqdm=False)
        want_pools, want_slots = one.pool_snapshot(), dict(one.cache.index.ckpts)
    with make_llm(ckpt, tp=2, speculative_config=spec, **kw) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, PARAMS, use_tqdm=False)]
        pools, slots = two.pool_snapshot(), dict(two.cache.index.ckpts)
        sd = two.stats()["spec_decode"]
        two.check_integrity()
    assert got == want
    assert sd["accepted_tokens"] > 0 and sd["draft_tokens"] > sd["accepted_tokens"], sd
    common = slots.keys() & want_slots.keys()  # the pools' sizes differ per rank: so may evictions
    assert len(common) >= 3
    for h in common:
        slot = slots[h]
        for key in ("checkpoint_states", "checkpoint_tails"):
            got_t, want_t = pools[key][:, slot], want_pools[key][:, want_slots[h]]
            assert torch.allclose(got_t, want_t, rtol=1e-5, atol=1e-5), key
