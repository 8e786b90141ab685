"""The draft_model method: a second checkpoint of our family drafts, and the answer never changes.

Greedy spec on == spec off over prefix hits, zero-draft steps, preemption (the drafter's state
rebuilt from tokens) and chunked prefill in both families (fp32); a drafter that is the target
itself is accepted (almost) always; seeded sampled outputs repeat; a drafter with another
vocabulary or tokenizer is refused; a proposer that taps the target's hidden states gets the
rows a cold forward computes."""

import json
import shutil

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.engine.spec.draft_model import DraftModelProposer
from deltaserve.engine.spec.drafters import NgramDrafter
from deltaserve.engine.spec.proposer import DraftRequest
from deltaserve.model.context import ForwardContext

from .helpers import engine, loopy_tiny
from .test_spec_identity import GREEDY, tokens, workload

K = 4


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpts(request, tmp_path_factory):
    """(target, drafter): two loopy checkpoints of one family, other seeds (so some drafts fail)."""
    d = tmp_path_factory.mktemp(request.param)
    return loopy_tiny(d / "target", request.param), loopy_tiny(d / "draft", request.param, seed=5)


def spec_of(path, **kw) -> dict:
    """Adaptive k off: a drafter as costly as the target never pays (adaptive.py), and these tests
    need its drafts."""
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K, "adaptive": False, **kw}


@pytest.mark.parametrize("pressure", [False, True], ids=["hits", "preemption"])
def test_greedy_spec_on_equals_off(ckpts, pressure):
    """As test_spec_identity's, with drafts from the second checkpoint (chunks of 29 tokens: the
    drafter's catch-up over a prompt is chunked too, a step without its drafts meanwhile)."""
    target, draft = ckpts
    kw = dict(num_pages=26, max_model_len=100, prefix=False) if pressure else dict(num_pages=80)
    on, off = engine(target, spec_of(draft), **kw), engine(target, None, **kw)
    first = workload(0)
    for prompts in (first, [p + q for p, q in zip(first, workload(2, 3))] + workload(1, 1)):
        assert tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(
            off.generate(prompts, GREEDY, use_tqdm=False)
        )
        on.check_integrity()
    stats = on.stats()
    sd, pc = stats["spec_decode"], stats.get("prefix_cache", {})
    dm = sd["draft_model"]
    assert sd["draft_tokens"] > 0 and 0 < sd["accepted_tokens"] < sd["draft_tokens"], sd
    assert sd["undrafted"] > 0, "verify steps held sequences without drafts"
    assert dm["forwards"] > 0 and dm["sequences"] == 0, dm  # every finished sequence's drafter cache freed
    if pressure:
        assert stats["preemptions"] > 0 and dm["rebuilds"] > 0, (stats, dm)
    else:
        assert pc.get("hits", 0) > 0, pc
    assert stats["steps"] < off.stats()["steps"], "accepted drafts saved steps"


def test_drafter_that_is_the_target_is_always_accepted(ckpts):
    """The target as its own drafter at temperature 0: its greedy drafts are the target's greedy
    tokens, so (up to fp32 near-ties) every draft is accepted and a drafted step yields ~k + 1."""
    target, _ = ckpts
    on = engine(target, spec_of(target, adaptive=False), prefix=False, max_model_len=120)
    off = engine(target, None, prefix=False, max_model_len=120)
    prompts = workload(4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert tokens(on.generate(prompts, params, use_tqdm=False)) == tokens(off.generate(prompts, params, use_tqdm=False))
    sd = on.stats()["spec_decode"]
    assert sd["accepted_tokens"] > 0 and sd["acceptance_rate"] >= 0.95, sd
    assert sd["mean_accepted_length"] >= K - 0.5, sd


def test_aborted_and_finished_sequences_free_the_drafters_cache(ckpts):
    target, draft = ckpts
    llm = engine(target, spec_of(draft), prefix=False)
    core, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(workload(5, 2)):
        core.add_request(f"r{i}", p, params)
    dm = core.spec.proposer
    while len(dm.computed) < 2:
        core.step()
    core.abort_request("r0")
    core.step()
    assert len(dm.computed) == 1 and len(dm.cache.seqs) == 1
    while core.has_unfinished():
        core.step()
    assert not dm.computed and not dm.cache.seqs and dm.cache.kda.num_used == 0
    dm.cache.check_integrity()


def test_a_drafter_pool_too_small_leaves_sequences_undrafted(ckpts):
    """12 drafter pages (48 tokens) for 4 sequences of 20-70 tokens: those it cannot hold go
    without drafts (never an error), the others draft; the tokens are the ones without spec."""
    target, draft = ckpts
    llm, off = engine(target, spec_of(draft), prefix=False), engine(target, None, prefix=False)
    small = DraftModelProposer(llm.engine.spec.proposer.model, 4, 160, K, 4, 29, max_pages=12)
    llm.engine.spec.proposer = small
    prompts = workload(6)
    want = tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    sd = llm.stats()["spec_decode"]
    assert sd["draft_tokens"] > 0 and small.cache.mla.num_pages == 12, sd
    assert max(len(p) for p in prompts) + GREEDY.max_tokens > 48
    small.cache.check_integrity()


def test_seeded_sampling_repeats(ckpts):
    target, draft = ckpts
    params = [SamplingParams(temperature=0.3, max_tokens=16, ignore_eos=True, seed=s) for s in range(3)]
    prompts = workload(7, 3)
    a, b = engine(target, spec_of(draft)), engine(target, spec_of(draft))
    first = tokens(a.generate(prompts, params, use_tqdm=False))
    assert tokens(b.generate(prompts, params, use_tqdm=False)) == first
    other = [SamplingParams(temperature=0.3, max_tokens=16, ignore_eos=True, seed=s + 9) for s in range(3)]
    assert tokens(b.generate(prompts, other, use_tqdm=False)) != first
    sd = a.stats()["spec_decode"]
    assert sd["draft_tokens"] > 0 and sd["accepted_tokens"] > 0, sd


def test_refuses_another_vocabulary_or_tokenizer(ckpts, tmp_path):
    target, draft = ckpts
    for name, edit, says in (
        ("vocab", lambda d: _edit_config(d, vocab_size=4096), "vocab_size"),
        ("ranks", lambda d: (d / "tiktoken.model").write_text((d / "tiktoken.model").read_text()[:-40]), "tokenizer"),
        ("specials", lambda d: _drop_special(d), "special tokens"),
    ):
        bad = shutil.copytree(draft, tmp_path / name)
        edit(bad)
        with pytest.raises(ValueError, match=says):
            engine(target, spec_of(bad))
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        engine(target, spec_of(tmp_path / "missing"))
    with pytest.raises(ValueError, match="required by, and only by, draft_model"):
        engine(target, {"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="required by, and only by, draft_model"):
        engine(target, {"method": "ngram", "num_speculative_tokens": 2, "model": str(draft)})


def _edit_config(d, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.get("text_config", cfg).update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _drop_special(d) -> None:
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    decoder = tcfg["added_tokens_decoder"]
    del decoder[max(decoder, key=int)]
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))


class TapRecorder:
    """A proposer that asks for the target's hidden states (records them) and drafts by n-gram."""

    wants_hidden = True

    def __init__(self):
        self.ngram, self.seen = NgramDrafter(2, 5), []

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        self.seen += [(r.seq.all_ids(), r.hidden) for r in requests]
        return [self.ngram.propose(r.seq, r.k) for r in requests]

    def release(self, seq) -> None:
        pass

    def finished(self, seq) -> None:
        pass

    def stats(self) -> dict:
        return {}


@torch.inference_mode()
def test_hidden_state_taps_are_the_targets_rows(ckpts):
    """Every `hidden` a tapping proposer gets equals a cold forward's final hidden rows at the
    positions whose outputs were the sequence's last tokens (verify steps: several rows)."""
    target, _ = ckpts
    llm = engine(target, {"method": "ngram", "num_speculative_tokens": K, "adaptive": False}, prefix=False)
    tap = llm.engine.spec.proposer = TapRecorder()
    outs = llm.generate(workload(3), GREEDY, use_tqdm=False)
    assert llm.stats()["spec_decode"]["accepted_tokens"] > 0
    model, rows = llm.model, 0
    for ids, hidden in tap.seen:
        if hidden is None:
            continue
        n = hidden.shape[0]
        cold = model(torch.tensor(ids), ForwardContext.single(len(ids), model.device))
        want = cold[len(ids) - 1 - n : len(ids) - 1]
        assert torch.allclose(hidden, want, rtol=1e-4, atol=1e-4)
        rows = max(rows, n)
    assert rows > 1, "a verify step's accepted drafts gave several rows"
    assert all(o.outputs[0].token_ids for o in outs)
