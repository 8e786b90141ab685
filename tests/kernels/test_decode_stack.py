"""The whole-stack decode kernel's contract (`ds_decode_stack`, `kernels/cpu/stack.py`): it checks
every index and the routers' limits before writing any pool, and refuses what it cannot run; the
MLA output gate rounds as torch does. Its results against the block-by-block and module-by-module
paths are checked in tests/engine/test_native_decode.py (bit for bit, through the engine)."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM
from deltaserve.kernels.cpu import AMX_ROWS, MAX_ROWS
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.tiny import make_tiny

NK = cpu_kernels.native()
pytestmark = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(the model's stack plan, hidden size, KDA pool shapes, MLA row width) of a tiny bf16 K3."""
    ckpt = make_tiny(tmp_path_factory.mktemp("k3"), "kimi_k3", mxfp4=True, seed=7)
    llm = LLM(ckpt, dtype="bfloat16", max_num_seqs=2, page_size=4, max_model_len=64, progress=False)
    plan = llm.model.model.prepared
    assert plan is not None and plan.kda_layers and plan.mla_layers
    kda = plan.struct.layers[plan.kda_layers[0]].kda.contents
    mla = plan.struct.layers[plan.mla_layers[0]].mla.contents
    p = kda.H * kda.K
    return llm, plan, kda.D, ((kda.W - 1, 3 * p), (kda.H, kda.K, kda.K)), mla.rank + mla.rope


def pools(plan, shapes, row_width, slots, write_rows, num_rows=16):
    """Zeroed pools of 4 slots and `num_rows` MLA rows per layer, with the step's indices."""
    (tail, state), n = shapes, slots.numel()
    kda = [(torch.zeros(4, *tail, dtype=torch.bfloat16), torch.zeros(4, *state), slots) for _ in plan.kda_layers]
    read = torch.arange(n, dtype=torch.long)
    cu = torch.arange(n + 1, dtype=torch.long)
    mla = [(torch.zeros(num_rows, row_width, dtype=torch.bfloat16), write_rows, read, cu) for _ in plan.mla_layers]
    return kda, mla


def untouched(kda, mla) -> bool:
    return all(not t.any() and not s.any() for t, s, _ in kda) and all(not r.any() for r, *_ in mla)


def test_a_step_runs_and_writes_its_slots_and_rows(stack):
    _, plan, d, shapes, width = stack
    kda, mla = pools(plan, shapes, width, torch.tensor([2, 0]), torch.tensor([5, 9]))
    x = torch.randn(2, d).to(torch.bfloat16)
    out = NK.decode_stack(plan, x, kda, mla)
    assert out.shape == (2, d) and torch.isfinite(out.float()).all()
    for tails, states, _ in kda:
        assert states[[0, 2]].abs().sum() > 0 and not states[[1, 3]].any()
    for rows, *_ in mla:
        assert rows[[5, 9]].abs().sum() > 0 and not rows[[0, 1, 2, 3, 4, 6, 7, 8]].any()


@pytest.mark.parametrize("bad", ["slot", "write_row"])
def test_an_index_out_of_range_raises_before_any_write(stack, bad):
    _, plan, d, shapes, width = stack
    slots = torch.tensor([1, 4 if bad == "slot" else 0])
    write_rows = torch.tensor([3, 16 if bad == "write_row" else 2])
    kda, mla = pools(plan, shapes, width, slots, write_rows)
    with pytest.raises(ValueError, match="out of range"):
        NK.decode_stack(plan, torch.randn(2, d).to(torch.bfloat16), kda, mla)
    assert untouched(kda, mla)


def test_logits_are_the_head_over_the_stack_of_the_embeddings(stack):
    """`decode_logits` (embedding rows, the stack and the output head in one call) gives the values
    of `compute_logits(decode_stack(embed_tokens(ids)))` bit for bit, and writes the pools alike."""
    llm, plan, d, shapes, width = stack
    assert plan.logits
    ids = torch.tensor([5, 170])
    kda, mla = pools(plan, shapes, width, torch.tensor([2, 0]), torch.tensor([5, 9]))
    kda2, mla2 = pools(plan, shapes, width, torch.tensor([2, 0]), torch.tensor([5, 9]))
    logits = NK.decode_logits(plan, ids, kda, mla)
    with torch.inference_mode():
        want = llm.model.compute_logits(NK.decode_stack(plan, llm.model.model.embed_tokens(ids), kda2, mla2))
    assert logits.dtype == torch.float32 and logits.shape == (2, llm.model.config.vocab_size)
    assert torch.equal(logits, want) and logits[0].ne(logits[1]).any()
    assert all(torch.equal(a, b) for (t, s, _), (t2, s2, _) in zip(kda, kda2) for a, b in ((t, t2), (s, s2)))
    assert all(torch.equal(r, r2) for (r, *_), (r2, *_) in zip(mla, mla2))


def test_a_token_id_out_of_range_raises_before_any_write(stack):
    llm, plan, d, shapes, width = stack
    kda, mla = pools(plan, shapes, width, torch.tensor([1, 0]), torch.tensor([3, 2]))
    for bad in (llm.model.config.vocab_size, -1):
        with pytest.raises(ValueError, match="out of range"):
            NK.decode_logits(plan, torch.tensor([0, bad]), kda, mla)
    assert untouched(kda, mla)


def test_a_router_outside_its_limits_declines_before_any_write(stack):
    """-3 from a router's static check: None (the caller runs the layers), nothing written."""
    _, plan, d, shapes, width = stack
    moe = next(y.moe.contents for y in plan.struct.layers[: plan.struct.L] if y.moe)
    kda, mla = pools(plan, shapes, width, torch.tensor([0]), torch.tensor([0]))
    old, moe.groups = moe.groups, 0
    try:
        assert NK.decode_stack(plan, torch.randn(1, d).to(torch.bfloat16), kda, mla) is None
    finally:
        moe.groups = old
    assert untouched(kda, mla)


def test_wrong_pools_and_batches_are_refused(stack):
    _, plan, d, shapes, width = stack
    kda, mla = pools(plan, shapes, width, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="bad input"):
        NK.decode_stack(plan, torch.randn(plan.max_rows + 1, d).to(torch.bfloat16), kda, mla)
    with pytest.raises(ValueError, match="one pool view per layer"):
        NK.decode_stack(plan, torch.randn(1, d).to(torch.bfloat16), kda[:-1], mla)
    bad = [(t.float(), s, i) for t, s, i in kda]
    with pytest.raises(ValueError, match="KDA pool"):
        NK.decode_stack(plan, torch.randn(1, d).to(torch.bfloat16), bad, mla)


def test_the_rows_a_step_takes_follow_the_tiles(stack):
    """Up to AMX_ROWS on tiles (every projection width a multiple of 32 here), else MAX_ROWS; turning
    the tiles off after the plan makes a wide step decline (None, nothing written)."""
    _, plan, d, shapes, width = stack
    assert plan.max_rows == (AMX_ROWS if NK.tiles else MAX_ROWS)
    if not NK.tiles:
        return
    n = MAX_ROWS + 1
    kda, mla = pools(plan, shapes, width, torch.arange(n) % 4, torch.arange(n))
    old_amx, old = NK.set_amx(False), NK.set_tiles(False)
    try:
        assert not NK.tiles
        assert NK.decode_stack(plan, torch.randn(n, d).to(torch.bfloat16), kda, mla) is None
    finally:
        NK.set_tiles(old)
        NK.set_amx(old_amx)
    assert untouched(kda, mla)


def test_sigmoid_mul_rounds_as_torch():
    """Two roundings as `o * torch.sigmoid(g)` on bf16; the exp differs from torch's in the last fp32
    bits, so a rare element may land one bf16 step away."""
    o, g = (torch.randn(4096, 64).to(torch.bfloat16) * 4 for _ in range(2))
    got, want = NK.sigmoid_mul(o, g).float(), (o * torch.sigmoid(g)).float()
    step = want.abs().clamp_min(1e-30) * 2**-7
    assert ((got - want).abs() <= step).all()
    assert (got == want).float().mean() > 0.999
