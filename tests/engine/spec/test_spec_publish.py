"""Never publish an unverified state: drafts poisoned with wrong tokens (or a draft model's that
the target rejects) are verified and rejected, and every KDA checkpoint and MLA unit the prefix
cache then holds equals a cold recompute of its prefix (any rejected token folded into a state
or left in a registered row would show)."""

import random

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.engine.spec.proposer import ModelFreeProposer
from deltaserve.model.config import ModelConfig
from deltaserve.model.context import DenseCache

from .helpers import copy_prompts, engine, loopy_tiny

PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpt(request, tmp_path_factory):
    return loopy_tiny(tmp_path_factory.mktemp(request.param), request.param)


class PoisonDrafter:
    """Drafts the true greedy continuation with one token replaced at a random position (most
    steps), the plain truth, or nothing."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int, seed: int):
        self.truth, self.vocab, self.rng = truth, vocab, random.Random(seed)
        self.poisoned = 0

    def propose(self, seq, k: int) -> list[int]:
        pos = len(seq.output_ids)
        drafts = list(self.truth[tuple(seq.prompt_ids)][pos : pos + k])
        r = self.rng.random()
        if r < 0.15 or not drafts:
            return []
        if r < 0.75:
            j = self.rng.randrange(len(drafts))
            drafts[j] = (drafts[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            self.poisoned += 1
        return drafts

    def finished(self, seq) -> None:
        pass


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@torch.inference_mode()
def cold(model, tokens: list[int]) -> DenseCache:
    dense = DenseCache(1)
    model(torch.tensor(tokens), dense.begin([len(tokens)]))
    return dense


@torch.inference_mode()
def test_published_states_equal_cold_recomputes(ckpt):
    spec = {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}
    llm, off = engine(ckpt, spec), engine(ckpt, None)
    vocab = llm.model.config.vocab_size
    prompts = copy_prompts(vocab, [9, 17, 12, 25], seed=3)
    truth = [o.outputs[0].token_ids for o in off.generate(prompts, PARAMS, use_tqdm=False)]
    poison = PoisonDrafter({tuple(p): t for p, t in zip(prompts, truth)}, vocab, seed=0)
    llm.engine.spec.proposer = ModelFreeProposer(poison)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert got == truth
    assert poison.poisoned > 10
    check_published(llm, prompts, truth)


@torch.inference_mode()
def test_draft_model_publishes_only_verified_states(ckpt, tmp_path):
    """The same check with a draft model whose drafts the target often rejects (another seed)."""
    family = ModelConfig.from_pretrained(ckpt).family
    draft = loopy_tiny(tmp_path / "draft", family, seed=5)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 5, "adaptive": False}
    llm, off = engine(ckpt, spec), engine(ckpt, None)
    prompts = copy_prompts(llm.model.config.vocab_size, [9, 17, 12, 25], seed=3)
    truth = [o.outputs[0].token_ids for o in off.generate(prompts, PARAMS, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == truth, family
    check_published(llm, prompts, truth)


def check_published(llm, prompts, truth) -> None:
    """Every checkpoint and unit past the prompts equals a cold recompute; some drafts rejected."""
    sd = llm.stats()["spec_decode"]
    assert sd["accepted_tokens"] > 0 and sd["accepted_tokens"] < sd["draft_tokens"], sd
    cache, u = llm.cache, llm.cache.policy.unit
    checked_states = checked_units = 0
    for prompt, out in zip(prompts, truth):
        tokens = prompt + out
        dense = cold(llm.model, tokens)
        for k, h in enumerate(cache.lookup(tokens + [0]).hashes, 1):
            if k * u <= len(prompt):
                continue  # prompt units: prefill, no drafts near them
            if h in cache.index.ckpts:
                state = cold(llm.model, tokens[: k * u])
                slot = cache.index.ckpts[h]
                for layer in llm.model.config.kda_layer_ids:
                    i = cache.ckpt_pool.layer_ids.index(layer)
                    tail, want = state.kda[layer]
                    assert rel_err(cache.ckpt_pool.states[i, slot], want[0]) < 1e-5
                    assert rel_err(cache.ckpt_pool.tails[i, slot], tail[0]) < 1e-5
                checked_states += 1
            if h in cache.index.units:
                rows = [p * cache.mla.rows_per_page + r for p in cache.index.units[h].pages for r in range(4)]
                for layer in llm.model.config.mla_layer_ids:
                    want = dense.mla[layer][0][(k - 1) * u : k * u]
                    assert rel_err(cache.mla.rows(layer)[rows], want) < 1e-5
                checked_units += 1
    assert checked_states >= 3 and checked_units >= 8, (checked_states, checked_units)
    llm.check_integrity()
