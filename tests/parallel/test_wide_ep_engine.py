"""`LLM(data_parallel_size=2, enable_expert_parallel=True)`: two replicas (gloo, one machine,
fp32) with their own schedulers and caches, the routed experts split between them and exchanged
by all-to-all in lock-step. Greedy outputs equal the one-process engine's for both families; each
replica's load report holds half the experts' bytes; the expert load covers every routed pair;
with every request on one replica, the other's zero-token forwards keep it going. With TP 2 inside
each replica (4 ranks) the same holds, each rank holding a quarter of the experts. In bf16 (the
native CPU kernels, MXFP4 experts kept packed) the shipped small K3's greedy outputs equal one
process's too; at TP 2 inside each replica they agree up to a near tie (it rounds otherwise)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.dp.client import replica_configs
from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.model.weights import load_model
from deltaserve.parallel import ParallelContext
from deltaserve.tiny import make_tiny
from deltaserve.tiny.shipped import shipped_model_dir

from .engine_fixtures import make_llm

FAMILIES = ("kimi_k3", "kimi_linear")
KW = dict(enable_prefix_caching=False, max_model_len=512, max_num_seqs=4)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 1800 + 40 for i in range(n)]


PROMPTS = [ids(1, 5), ids(2, 40), ids(3, 17), ids(4, 9), ids(5, 23), ids(6, 3)]
PARAMS = [SamplingParams(max_tokens=m, temperature=0) for m in (6, 3, 9, 4, 7, 5)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wide_ep")
    return {f: make_tiny(root / f, f, "tiny", seed=7) for f in FAMILIES}


def _expert_bytes(path: Path) -> tuple[int, int, int]:
    """(routed expert bytes, MoE layers, top-k) of the whole fp32 model."""
    model = load_model(path, "float32", progress=False)
    moe = [n for n, _ in model.named_parameters() if n.endswith(".experts.w1")]
    size = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return size, len(moe), model.config.moe.top_k


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_dp2_expert_parallel_equals_one_engine(ckpts, family):
    path = ckpts[family]
    with make_llm(path, **KW) as one:
        want = one.generate(PROMPTS, PARAMS, use_tqdm=False)
        whole_bytes = one.rank_memory[0]["weight_bytes"]
    with make_llm(path, data_parallel_size=2, enable_expert_parallel=True, **KW) as two:
        got = two.generate(PROMPTS, PARAMS, use_tqdm=False)
        stats, memory = two.stats(), two.rank_memory
    assert _tokens(got) == _tokens(want)
    assert all(s["requests_added"] > 0 for s in stats["replicas"])  # both replicas had work
    experts, layers, top_k = _expert_bytes(path)
    assert len(memory) == 2
    for m in memory:  # each rank: everything but the other half of the experts
        assert m["weight_bytes"] == whole_bytes - experts // 2
    load = stats["expert_load"]
    assert len(load) == 8 and [r["expert_load"]["first"] for r in stats["replicas"]] == [0, 4]
    assert sum(load) == top_k * layers * stats["computed_tokens"]  # every routed pair ran once


@pytest.mark.parametrize("family,tp", [("kimi_k3", 1), ("kimi_linear", 2)])
def test_an_idle_replica_keeps_the_other_going(ckpts, family, tp):
    """One request on two replicas (TP 1 or 2 inside each): the idle one runs a zero-token forward
    per step of the busy one, so the exchanges stay in step and the busy one finishes."""
    path = ckpts[family]
    with make_llm(path, **KW) as one:
        want = one.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
    with make_llm(path, tp=tp, data_parallel_size=2, enable_expert_parallel=True, **KW) as two:
        got = two.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False)
        busy, idle = sorted(two.stats()["replicas"], key=lambda s: -s["requests_added"])
    assert _tokens(got) == _tokens(want)
    assert (busy["requests_added"], idle["requests_added"]) == (1, 0)
    assert idle["idle_forwards"] == busy["steps"] > 0  # one zero-token forward per step of the other
    assert busy["idle_forwards"] == 0 and idle["steps"] == 0


def _rank_bytes(path: Path, rank: int, tp: int) -> tuple[int, int]:
    """(weight bytes, routed expert bytes) of plain TP rank `rank` of `tp` (experts split by width)."""
    model = load_model(path, "float32", progress=False, tp=ParallelContext(rank, tp))
    named = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for _, t in named), sum(
        t.numel() * t.element_size() for n, t in named if ".experts." in n
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_dp2_tp2_expert_parallel_equals_one_engine(ckpts, family):
    """DP2 x TP2: 4 ranks, attention split in two inside each replica, the experts over all 4."""
    path, prompts, params = ckpts[family], PROMPTS[:4], PARAMS[:4]
    with make_llm(path, **KW) as one:
        want = one.generate(prompts, params, use_tqdm=False)
    with make_llm(path, tp=2, data_parallel_size=2, enable_expert_parallel=True, **KW) as four:
        got = four.generate(prompts, params, use_tqdm=False)
        stats, memory = four.stats(), four.rank_memory
    assert _tokens(got) == _tokens(want)
    assert all(s["requests_added"] > 0 for s in stats["replicas"])  # both replicas had work
    experts, layers, top_k = _expert_bytes(path)
    assert len(memory) == 4
    for rank, m in enumerate(memory):  # TP rank t's attention shard, a quarter of the experts
        tp_bytes, tp_experts = _rank_bytes(path, rank % 2, 2)
        assert m["weight_bytes"] == tp_bytes - tp_experts + experts // 4, rank
    load = stats["expert_load"]
    assert len(load) == 8 and [r["expert_load"]["first"] for r in stats["replicas"]] == [0, 4]
    assert sum(load) == top_k * layers * stats["computed_tokens"]  # every routed pair ran once


def test_wide_ep_replica_configs():
    c = EngineConfig(model="m", data_parallel_size=3, enable_expert_parallel=True, num_threads=1)
    configs = replica_configs(c)
    assert [x.data_parallel_rank for x in configs] == [0, 1, 2]
    assert len({x.data_parallel_init_method for x in configs}) == 1 and configs[0].data_parallel_init_method
    assert all(x.wide_expert_parallel and x.data_parallel_size == 3 for x in configs)
    tp2 = EngineConfig(model="m", data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=2)
    tp2.check_parallel()  # TP inside a wide-EP replica: test_dp2_tp2_expert_parallel_equals_one_engine
    dcp = dataclasses.replace(tp2, decode_context_parallel_size=2)
    with pytest.raises(ValueError, match="decode_context_parallel_size must be 1"):
        dcp.check_parallel()


def _close(got, want, top: int, gap: float) -> int:
    """Greedy outputs agree up to each sequence's first differing token, where each side's token is
    in the other's `top` log-probabilities within `gap` of its best (a near tie that rounding can
    flip; vLLM's check_logprobs_close); returns the sequences that diverged."""
    diverged = 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a != b:
                assert a in w.logprobs[i] and b in g.logprobs[i], (i, a, b)
                assert w.logprobs[i][b].logprob - w.logprobs[i][a].logprob < gap, (i, w.logprobs[i])
                diverged += 1
                break
        else:
            assert len(g.token_ids) == len(w.token_ids)
    return diverged


@pytest.mark.parametrize("tp", [1, 2])
def test_bf16_packed_experts_on_the_shipped_model(tp):
    """TP 1 inside each replica rounds as one process does: the same tokens. TP 2 inside a wide-EP
    replica rounds otherwise (measured: it gives the fp32 engine's tokens on "What is 2+3?", where
    one bf16 process takes the other side of a near tie), so there the outputs must agree up to a
    near tie."""
    chat = ["Hello", "What is 2+3?", "Tell me a story about the sea", "hi"]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5)
    kw = dict(KW, skip_tokenizer_init=False, dtype="bfloat16")
    with make_llm(shipped_model_dir("kimi_k3"), **kw) as one:
        want = one.generate(chat, params, use_tqdm=False)
    with make_llm(shipped_model_dir("kimi_k3"), tp, data_parallel_size=2, enable_expert_parallel=True, **kw) as two:
        got = two.generate(chat, params, use_tqdm=False)
        assert all(s["requests_added"] > 0 for s in two.stats()["replicas"])
    if tp == 1:
        assert _tokens(got) == _tokens(want)
    else:
        assert _close(got, want, 5, 0.25) <= 1
