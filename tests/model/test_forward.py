"""forward_full on tiny checkpoints vs independent paths: a cached second path (prefill a prefix,
then decode the rest token by token with the recurrent KDA step and absorbed MLA), causality,
and for Kimi-Linear the `transformers` implementation on identical weights."""

import pytest
import torch

from deltaserve.model import load_model
from deltaserve.model.context import DenseCache
from deltaserve.ops.backends.torch import TorchOps
from deltaserve.tiny import make_tiny

CASES = [("kimi_k3", False), ("kimi_k3", True), ("kimi_linear", False)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'-mxfp4' if c[1] else ''}")
def model(request, tmp_path_factory):
    family, mxfp4 = request.param
    out = make_tiny(tmp_path_factory.mktemp(family), family=family, preset="tiny", mxfp4=mxfp4, seed=3)
    return load_model(out, dtype=torch.float32, progress=False)


def prompt(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g)


def test_logits_depend_on_input(model):
    a, b = model.forward_full(prompt(model, 12, 1)), model.forward_full(prompt(model, 12, 2))
    assert torch.isfinite(a).all() and (a - b).abs().max() > 1e-3
    assert a[-1].std() > 1e-3


def test_causal(model):
    ids = prompt(model, 150)
    full = model.forward_full(ids)
    part = model.forward_full(ids[:70])
    torch.testing.assert_close(part, full[:70], rtol=1e-5, atol=3e-5)


@torch.inference_mode()
def test_prefill_then_decode_matches_full(model):
    ids = prompt(model, 80, seed=5)
    full = model.forward_full(ids)
    cache = DenseCache(1)
    ctx = cache.begin([50])
    hidden = model(ids[:50], ctx)
    cache.end()
    rows = [model.compute_logits(hidden)]
    for t in range(50, 80):
        ctx = cache.begin([1])
        assert cache.decode_only
        rows.append(model.compute_logits(model(ids[t : t + 1], ctx)))
        cache.end()
    torch.testing.assert_close(torch.cat(rows), full, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_packed_chunks_match_full(model, monkeypatch):
    """Two sequences packed in one step, continued in uneven chunks: MLA over the cached context
    unabsorbed for a chunk of more queries than the break-even (32 at the tiny sizes: the 64-token
    chunk), absorbed for the rest, both in the middle step."""
    forms = {"unabsorbed": 0, "absorbed": 0}
    for name, owner, attr in (
        ("unabsorbed", TorchOps, "mla_context_prefill"),
        ("absorbed", TorchOps, "mla_absorbed"),
    ):
        real = getattr(owner, attr)

        def counted(*args, _real=real, _name=name, **kwargs):
            forms[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, attr, counted)
    a, b = prompt(model, 90, 7), prompt(model, 33, 8)
    cache = DenseCache(2)
    out_a, out_b = [], []
    for la, lb in [(17, 5), (64, 27), (9, 1)]:
        sa, sb = sum(len(x) for x in out_a), sum(len(x) for x in out_b)
        ctx = cache.begin([la, lb])
        h = model.compute_logits(model(torch.cat([a[sa : sa + la], b[sb : sb + lb]]), ctx))
        cache.end()
        out_a.append(h[:la])
        out_b.append(h[la:])
    assert forms["unabsorbed"] > 0 and forms["absorbed"] > 0, forms
    torch.testing.assert_close(torch.cat(out_a), model.forward_full(a), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(out_b), model.forward_full(b), rtol=1e-4, atol=1e-4)


def test_kimi_linear_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = make_tiny(tmp_path / "kl", family="kimi_linear", preset="tiny", seed=11)
    ours = load_model(out, dtype=torch.float32, progress=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = prompt(ours, 100, 4)
    with torch.no_grad():
        ref = theirs(ids[None], use_cache=False).logits[0].float()
    got = ours.forward_full(ids)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-5, f"relative error vs transformers {rel:.2e}"
