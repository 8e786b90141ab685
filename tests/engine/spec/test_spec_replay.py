"""The chained verify's rollback replays the verified rows' KDA updates from the step's record
(ops/kda_record.py, `ds_kda_replay`) instead of running them through the model again: after a
verify with rejected drafts every slot's conv tails and states equal, bit for bit, those that plain
one-token decode steps of the verified tokens leave from the pre-verify state; the fold runs no
forward pass. Whichever native path ran the step records it: the whole-stack call, the per-layer
block kernel, or the projections around the decode kernel."""

import pytest
import torch

from deltaserve.engine.exec.chained_verify import ChainedVerify, rows_of
from deltaserve.engine.exec.messages import Step
from deltaserve.engine.exec.step_batch import forward_batch
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.kernels.cpu.library import NativeKernels

from ...kernel_calls import count_kernel_calls
from .helpers import engine, loopy_tiny

pytestmark = pytest.mark.skipif(cpu_kernels.native() is None, reason="native CPU kernels unavailable")

# per sequence: prompt length, fed tokens (its token and drafts), verified of them; 8 rows in all
# (the decode GEMVs' row limit: past it the tile kernels round otherwise than a one-row step)
SEQS = [(9, 4, 2), (6, 3, 3), (11, 1, 1)]


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def llm(request, tmp_path_factory):
    return engine(loopy_tiny(tmp_path_factory.mktemp(request.param), request.param), None, dtype="bfloat16")


def _run(model, cache, step: Step, decode: bool) -> None:
    batch = forward_batch(step, cache.mla, cache.kda, cache.ckpt_pool, model.device)
    (model.decode_logits if decode else model)(batch.input_ids, batch.context())


def _admit(model, cache, gen) -> list[tuple[list[int], list[int], int, list[int], int]]:
    """Each sequence of SEQS prefilled: (prompt, fed tokens, verified count, pages, slot)."""
    out = []
    for i, (n, fed, verified) in enumerate(SEQS):
        seq_id = 9000 + i
        assert cache.admit(seq_id, n + fed)
        c = cache.seqs[seq_id]
        prompt, ids = (torch.randint(model.config.vocab_size, (m,), generator=gen).tolist() for m in (n, fed))
        _run(model, cache, Step([], prompt, [0], [n], [list(c.pages)], [c.slot], None, [], [n - 1]), False)
        out.append((prompt, ids, verified, list(c.pages), c.slot))
    return out


def _slots(cache, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.tensor(slots)
    return cache.kda.tails.index_select(1, idx).clone(), cache.kda.states.index_select(1, idx).clone()


@pytest.mark.parametrize("path", ["stack", "block", "projections"])
@torch.inference_mode()
def test_fold_replays_the_verified_rows_bit_for_bit(llm, path, monkeypatch):
    runner = llm.engine.runner
    model, cache = runner.model, runner.cache
    if path != "stack":  # the layers one by one: each KDA layer's block kernel, or past its rows
        monkeypatch.setattr(model.model, "prepared", None)
    if path == "projections":
        monkeypatch.setattr(NativeKernels, "kda_block_rows", lambda self, plan: 0)
    seqs = _admit(model, cache, torch.Generator().manual_seed(5))
    slots = [s for *_, s in seqs]
    pre = _slots(cache, slots)
    step = Step(
        [],
        [t for _, ids, *_ in seqs for t in ids],
        [len(p) for p, *_ in seqs],
        [len(ids) for _, ids, *_ in seqs],
        [pages for *_, pages, _ in seqs],
        slots,
        None,
        [],
        list(range(sum(fed for _, fed, _ in SEQS))),
        verify=[True] * len(seqs),
    )
    chained = ChainedVerify(step, rows_of(step), [True] * len(seqs), cache)
    chained.logits(model)
    assert chained.record.covers(model.config.kda_layer_ids)
    calls = count_kernel_calls(monkeypatch, ["kda_replay", "decode_logits", "decode_stack", "kda_block"])
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("the fold ran the model"))
    chained.fold(model, [v for *_, v in SEQS])
    assert dict(calls) == {"kda_replay": 1}, calls
    got = _slots(cache, slots)
    monkeypatch.undo()  # the reference runs on the model as it was
    idx = torch.tensor(slots)
    cache.kda.tails.index_copy_(1, idx, pre[0])
    cache.kda.states.index_copy_(1, idx, pre[1])
    for prompt, ids, verified, pages, slot in seqs:  # plain decode steps, one token each
        for j in range(verified):
            _run(model, cache, Step([], [ids[j]], [len(prompt) + j], [1], [pages], [slot], None, [], [0]), True)
    want = _slots(cache, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(want[1], pre[1])
    for i in range(len(seqs)):
        cache.free(9000 + i)
