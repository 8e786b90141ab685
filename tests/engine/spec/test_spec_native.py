"""Speculative verify steps on the native CPU backend (bf16) run as chained decode rows
(engine/exec/chained_verify.py): greedy output equals spec off token for token (the same kernels
and roundings as plain decode steps), over rejected drafts (the slot restored and the verified
rows run again), prefix hits and preemption, in both families."""

import pytest

from deltaserve import SamplingParams
from deltaserve.engine.exec import chained_verify
from deltaserve.kernels.cpu import library as cpu_kernels

from .helpers import engine, loopy_tiny
from .test_spec_identity import tokens, workload

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
