"""Memoised derived weights (model/modules.cached_object) and the per-pass `weights_pinned` stamp:
a changed weight (in place, new storage, or a re-assigned Parameter) must never leave a stale
plan, and a pinned pass must not re-evaluate the sources it already validated."""
from __future__ import annotations

import torch
from torch import nn

from deltaserve import LLM, SamplingParams
from deltaserve.model.modules import cached_object, weights_pinned
from deltaserve.model.tiny import make_tiny


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        self.builds = 0
        self.source_calls = 0

    def derived(self) -> torch.Tensor:
        def build():
            self.builds += 1
            return self.lin.weight.sum()

        def sources():
            self.source_calls += 1
            return [self.lin.weight]
        return cached_object(self, "sum", build, sources)


def test_memo_rebuilds_on_every_kind_of_weight_change():
    m = Holder()
    first = m.derived()
    assert m.derived() is first and m.builds == 1
    with torch.no_grad():
        m.lin.weight.add_(1.0)                       # in place: _version moves
    assert torch.equal(m.derived(), m.lin.weight.sum()) and m.builds == 2
    m.lin.weight.data = torch.zeros(4, 4)            # new storage
    assert float(m.derived()) == 0.0 and m.builds == 3
    m.lin.weight = nn.Parameter(torch.ones(4, 4))    # a re-assigned Parameter
    assert float(m.derived()) == 16.0 and m.builds == 4


def test_pinned_pass_skips_validated_sources_and_sees_changes_next_pass():
    m = Holder()
    with weights_pinned(m):
        m.derived()
        calls = m.source_calls
        for _ in range(3):
            m.derived()
        assert m.source_calls == calls               # validated once in this stamp: trusted
    with weights_pinned(m):
        m.derived()
        assert m.source_calls == calls and m.builds == 1   # same stamp, next pass
    with torch.no_grad():
        m.lin.weight.mul_(2.0)
    with weights_pinned(m):                          # the stamp moved: validate and rebuild
        assert torch.equal(m.derived(), m.lin.weight.sum()) and m.builds == 2
    m.lin.weight = nn.Parameter(torch.full((4, 4), 3.0))
    with weights_pinned(m):
        assert float(m.derived()) == 48.0 and m.builds == 3


def test_pinned_pass_sees_buffer_changes():
    """Packed MXFP4 experts are buffers: the per-pass stamp covers them too."""
    m = Holder()
    m.register_buffer("packed", torch.ones(3))

    def derived():
        return cached_object(m, "buf", lambda: m.packed.sum(), lambda: [m.packed])
    with weights_pinned(m):
        assert float(derived()) == 3.0
    m.packed.mul_(2.0)
    with weights_pinned(m):
        assert float(derived()) == 6.0
    m.packed = torch.zeros(3)                        # a re-registered buffer
    with weights_pinned(m):
        assert float(derived()) == 0.0


def test_engine_decode_plans_follow_a_weight_changed_between_requests(tmp_path):
    """The native block plans (memoised on the layers, with fp32 and transposed copies of some
    weights) must see an in-place weight change: the engine's tokens afterwards equal those of a
    fresh engine built with the changed weights."""
    ckpt = make_tiny(tmp_path / "k3", "kimi_k3", seed=9)
    prompt, params = list(range(200, 230)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_model_len=128, kv_cache_memory=16 * 2**20, progress=False)

    def scale_weights(llm):   # weights the plans hold derived copies of (fp32, transposed)
        with torch.no_grad():
            for layer in llm.model.model.layers:
                attn = layer.self_attn
                (attn.o_norm.weight if hasattr(attn, "o_norm") else attn.kv_b_proj.weight).mul_(-3.0)

    llm = LLM(ckpt, **kw)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    scale_weights(llm)
    after = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    fresh = LLM(ckpt, **kw)
    scale_weights(fresh)
    assert after == fresh.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert after != before                           # the change mattered, so the check can fail
