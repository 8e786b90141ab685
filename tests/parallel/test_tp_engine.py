"""The engine over two tensor-parallel processes (rank 0 schedules, a spawned worker follows its
`Step` messages): the same greedy tokens and logprobs as one process on both families, bf16-stored
and MXFP4 experts; with prefix caching, preemption and aborts every rank's pools hold exactly what
one process's hold (gathered by `pool_snapshot`), and cache on == off."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.kernels.cpu.library import NativeKernels

from .engine_fixtures import make_llm, write_checkpoints

# three short prompts and one whose step message overflows the channel's first frame
PROMPTS = [[5 + i for i in range(n)] for n in (7, 19, 33)] + [[(7 * i) % 2000 + 40 for i in range(3000)]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("tp_engine"))


def _run(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, torch.tensor(logprobs)


LAYOUTS = {  # two processes each
    "tp2": {},
    "ep2": dict(enable_expert_parallel=True),
    "dcp2": dict(decode_context_parallel_size=2),
}


@pytest.mark.parametrize("name", ["k3", "k3_mx", "kl", "kl_mx"])
def test_two_ranks_generate_what_one_process_does(ckpts, name):
    with make_llm(ckpts[name]) as one:
        want, want_lp = _run(one, PROMPTS)
    for layout, kw in LAYOUTS.items():
        with make_llm(ckpts[name], tp=2, **kw) as two:
            got, got_lp = _run(two, PROMPTS)
            memory = two.rank_memory
            stats = two.stats()
        assert got == want, layout
        assert (got_lp - want_lp).abs().max() <= 1e-5 * max(1.0, want_lp.abs().max().item()), layout
        assert len(memory) == 2 and memory[0]["weight_bytes"] == memory[1]["weight_bytes"] > 0
        assert stats["steps"] > 0


def _workload(llm) -> tuple[list, dict]:
    """Shared-prefix requests through prefix caching with a pool small enough to preempt, one
    request aborted mid-run; returns (finished tokens by request id, stats)."""
    core = llm.engine
    base = [(11 * i) % 1900 + 30 for i in range(150)]
    params = SamplingParams(max_tokens=24, temperature=0)
    for i in range(6):
        core.add_request(f"r{i}", base + [100 + i] * (i + 1), params)
    done, steps = {}, 0
    while core.has_unfinished():
        for out in core.step():
            done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 5:
            core.abort_request("r3")
        if steps == 12:  # a second turn of r0, after its first finished or not
            core.add_request("r0b", base + [100], params)
    llm.check_integrity()
    return done, llm.stats()


@pytest.mark.parametrize("layout", ["tp2", "dcp2"])
def test_two_ranks_prefix_cache_preemption_aborts_keep_every_rank_exact(ckpts, layout):
    kw = dict(enable_prefix_caching=True, max_num_seqs=4, max_model_len=256, page_size=16)
    # per-rank budgets: a rank's KDA slot is half as big (and under DCP its page too), so it gets
    # less memory for the same 16 MLA pages, 4 live and 1 checkpoint slot (asserted below)
    with make_llm(ckpts["k3"], kv_cache_memory=400_000, checkpoint_fraction=0.25, **kw) as one:
        want, want_stats = _workload(one)
        want_pools = one.pool_snapshot()
        layout_one = one.layout
    budget = 240_000 if layout == "tp2" else 200_000
    with make_llm(ckpts["k3"], tp=2, kv_cache_memory=budget, checkpoint_fraction=0.2, **kw, **LAYOUTS[layout]) as two:
        got, stats = _workload(two)
        pools = two.pool_snapshot()
        assert (two.layout.num_pages, two.layout.num_checkpoint_slots) == (layout_one.num_pages, 1) == (16, 1)
    with make_llm(ckpts["k3"], tp=2, max_num_seqs=4, max_model_len=256, **LAYOUTS[layout]) as off:
        cold, _ = _workload(off)
    assert got == want == cold
    assert "r3" not in got and stats["requests_aborted"] == 1
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["hits"] > 0
    assert stats["prefix_cache"] == want_stats["prefix_cache"]
    assert set(pools) == set(want_pools) and "checkpoint_states" in pools
    for key, want_t in want_pools.items():
        got_t = pools[key]
        if key == "mla" and layout == "tp2":  # every rank holds the whole latent cache under plain TP
            assert got_t.shape[0] == 2 and torch.equal(got_t[0], got_t[1])
            got_t = got_t[:1]
        elif key == "mla":  # under DCP rank r holds positions r, r + 2, ... of every page
            got_t = torch.stack([got_t[0], got_t[1]], dim=3).flatten(2, 3).unsqueeze(0)
        assert got_t.shape == want_t.shape, key
        assert torch.allclose(got_t, want_t, rtol=1e-5, atol=1e-5), key


@pytest.mark.parametrize("layout", ["tp2", "ep2", "dcp2"])
@pytest.mark.parametrize("name", ["k3", "k3_mx", "kl"])
def test_decode_stack_under_tensor_parallelism_is_the_layer_path(ckpts, name, layout, monkeypatch):
    """bf16 over two ranks (experts split by width, or by expert; or MLA rows split by position, its
    layers called back): each rank's decode steps as one native call (the stack calling the
    all-reduces back where the layers' outputs are partial) give the tokens and logprobs of the same
    two ranks stepping layer by layer, bit for bit; every rank reports which way it ran."""
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
    stepped = []  # rank 0's decode steps the stack computed (a declined step returns None)
    real = NativeKernels.decode_stack

    def counted(self, *a, **kw):
        out = real(self, *a, **kw)
        stepped.append(out is not None)
        return out

    monkeypatch.setattr(NativeKernels, "decode_stack", counted)
    runs = {}
    for stack in (1, 0):
        monkeypatch.setenv("DELTASERVE_DECODE_STACK", str(stack))
        with make_llm(ckpts[name], tp=2, dtype="bfloat16", max_num_seqs=2, **LAYOUTS[layout]) as two:
            runs[stack] = _run(two, PROMPTS[:3], params)
            memory = two.rank_memory
        assert [m["decode_stack"] for m in memory] == [stack, stack], memory
        assert (sum(stepped) > 0) == bool(stack) and all(stepped)
        stepped.clear()
    assert runs[1][0] == runs[0][0]
    assert torch.equal(runs[1][1], runs[0][1])
