"""Speculative verify steps on the native CPU backend (bf16) run as chained decode rows
(engine/exec/chained_verify.py): greedy output equals spec off token for token (the same kernels
and roundings as plain decode steps), over rejected drafts (the slot restored and the verified
rows run again), prefix hits and preemption, in both families."""

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.engine.exec import chained_verify
from deltaserve.engine.spec.proposer import ModelFreeProposer
from deltaserve.kernels.cpu import library as cpu_kernels

from .helpers import copy_prompts, engine, loopy_tiny
from .test_spec_identity import tokens, workload
from .test_spec_publish import PARAMS, PoisonDrafter, rel_err

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
pytestmark = pytest.mark.skipif(cpu_kernels.native() is None, reason="native CPU kernels unavailable")


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpt(request, tmp_path_factory):
    return loopy_tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("pressure", [False, True], ids=["hits", "preemption"])
def test_native_verify_rows_keep_greedy_output(ckpt, pressure, method, monkeypatch):
    """draft_model: the target as its own draft, its catch-up of verified tokens also as chained
    rows (adaptive k off: such a drafter never pays)."""
    folds = []
    real = chained_verify.ChainedVerify.fold

    def fold(self, model, verified):
        folds.append(any(m < self.step.new_lens[b] for b, m in zip(self.verify, verified)))
        return real(self, model, verified)

    monkeypatch.setattr(chained_verify.ChainedVerify, "fold", fold)
    kw = dict(num_pages=26, max_model_len=100, prefix=False) if pressure else dict(num_pages=80)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}  # some drafts rejected
    if method == "draft_model":
        spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(ckpt), "adaptive": False}
    on, off = engine(ckpt, spec, dtype="bfloat16", **kw), engine(ckpt, None, dtype="bfloat16", **kw)
    first = workload(0)
    for prompts in (first, [p + q for p, q in zip(first, workload(2, 3))] + workload(1, 1)):
        assert tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(
            off.generate(prompts, GREEDY, use_tqdm=False)
        )
        on.check_integrity()
    sd = on.stats()["spec_decode"]
    assert sd["accepted_tokens"] > 0 and folds and not all(folds), (sd, folds)
    if method == "ngram":
        assert any(folds), "some verify steps were restored and run again"
    assert on.stats()["steps"] < off.stats()["steps"]
    if method == "draft_model":  # the drafter's rows round as the target's decode: every draft is its token
        assert sd["draft_model"]["forwards"] > 0 and sd["acceptance_rate"] == 1.0, sd


@torch.inference_mode()
def test_native_verify_publishes_the_states_spec_off_publishes(ckpt):
    """Poisoned drafts (test_spec_publish's) through the chained rows: every KDA checkpoint and MLA
    unit the prefix cache publishes is the one a spec-off engine publishes for the same prefix (the
    same decode kernels; most are bit-equal, some differ by roundings where a step's row count
    picks another GEMM kernel: spec off at batch 4 vs 1 differs by up to 4e-3 relative in
    Kimi-Linear states, 2e-7 in K3's; a rejected token folded in or left in a row differs by far
    more: keeping the slot past rejected rows fails this test)."""
    on = engine(ckpt, {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}, dtype="bfloat16")
    off = engine(ckpt, None, dtype="bfloat16")
    prompts = copy_prompts(on.model.config.vocab_size, [9, 17, 12, 25], seed=3)
    truth = [o.outputs[0].token_ids for o in off.generate(prompts, PARAMS, use_tqdm=False)]
    poison = PoisonDrafter({tuple(p): t for p, t in zip(prompts, truth)}, on.model.config.vocab_size, seed=0)
    on.engine.spec.proposer = ModelFreeProposer(poison)
    assert [o.outputs[0].token_ids for o in on.generate(prompts, PARAMS, use_tqdm=False)] == truth
    assert poison.poisoned > 10
    a, b = on.cache, off.cache
    states = units = 0
    for h, slot in a.index.ckpts.items():
        if h in b.index.ckpts:
            other = b.index.ckpts[h]
            assert rel_err(a.ckpt_pool.states[:, slot], b.ckpt_pool.states[:, other]) < 1e-2
            assert rel_err(a.ckpt_pool.tails[:, slot], b.ckpt_pool.tails[:, other]) < 2e-2
            states += 1
    for h, unit in a.index.units.items():
        if h in b.index.units:
            for layer in on.model.config.mla_layer_ids:
                mine, theirs = (
                    [p * a.mla.rows_per_page + r for p in u.pages for r in range(4)] for u in (unit, b.index.units[h])
                )
                assert rel_err(a.mla.rows(layer)[mine], b.mla.rows(layer)[theirs]) < 2e-2
            units += 1
    assert states >= 3 and units >= 8, (states, units)


def test_bf16_steps_stay_within_the_bit_identical_rows(ckpt, monkeypatch):
    """Twelve sequences drafting every step they may (adaptive off): on the native bf16 path a
    step's decode rows and drafts stay within `BIT_IDENTICAL_ROWS`, so greedy output equals spec
    off (past 8 rows a verify takes the tile kernels and rounds otherwise: bench spec's batch 8
    copy row drifted on the default model before the cap)."""
    from deltaserve.engine.sched.scheduler import Scheduler
    from deltaserve.engine.spec.decoder import BIT_IDENTICAL_ROWS

    widths = []
    real = Scheduler.schedule

    def schedule(self):
        out = real(self)
        if any(s.drafts for s in out):  # the decode rows and their drafts
            widths.append(sum(s.width for s in out if s.num_new == 1))
        return out

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    kw = dict(dtype="bfloat16", num_pages=200, max_num_seqs=12, max_num_batched_tokens=64)
    on, off = engine(ckpt, spec, **kw), engine(ckpt, None, **kw)
    prompts = workload(5, 12)
    assert tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    assert widths and max(widths) <= BIT_IDENTICAL_ROWS, widths
    assert on.stats()["spec_decode"]["accepted_tokens"] > 0
    assert on.engine.scheduler.max_step_rows == BIT_IDENTICAL_ROWS
