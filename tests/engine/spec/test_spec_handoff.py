"""A disaggregated handoff into a speculating decode engine (the engine and cache sides, bytes copied
as the transfer engine would): the decode side verifies drafts from the received state and gives
the colocated greedy tokens without speculation, turn after turn (its prefix cache shortening the
later transfers), with drafts accepted."""

from __future__ import annotations

import random

import pytest

from deltaserve import SamplingParams

from ...disagg.pd_fixtures import make_llm
from ...disagg.test_handoff_engine import _handoff, _run
from .helpers import loopy_tiny

PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return loopy_tiny(tmp_path_factory.mktemp("spec_pd"), "kimi_k3")


@pytest.mark.parametrize("method", ["suffix", "draft_model"])
def test_handoff_into_a_speculating_decode_engine(ckpt, method):
    """draft_model (the checkpoint drafting for itself): the drafter never saw the prefill, so it
    rebuilds the received request's state from its tokens before its first drafts."""
    p, ref = make_llm(ckpt), make_llm(ckpt)
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    spec |= {"model": str(ckpt)} if method == "draft_model" else {}
    d = make_llm(ckpt, speculative_config=spec)
    rng = random.Random(5)
    base = [rng.randrange(10, 1700) for _ in range(40)]
    history = base + base[:20]
    for turn in range(2):
        want = ref.generate([{"prompt_token_ids": history}], PARAMS)[0].outputs[0]
        res, _ = _handoff(p, d, f"t{turn}", history)
        d.engine.add_request(f"t{turn}", history, PARAMS, received=res.seq_id)
        got = _run(d.engine)[0].outputs[0]
        assert got.token_ids == want.token_ids
        history = history + list(got.token_ids) + base[:10]
    sd = d.stats()["spec_decode"]
    assert d.cache.counters["received"] == 2 and sd["accepted_tokens"] > 0, sd
    if method == "draft_model":  # the drafter fed every received prompt token itself
        assert sd["draft_model"]["catchup_tokens"] >= len(history) - len(base[:10]), sd
    d.cache.check_integrity()
    assert d.cache.kda.num_used == 0
