"""The engine against the no-cache reference: greedy outputs equal repeated `forward_full`,
under tiny chunk budgets and a page pool small enough to force preemptions."""

import random

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.cache.budget import kda_shapes
from deltaserve.cache.kda_pool import KdaStatePool
from deltaserve.cache.mla_pool import MlaPagePool
from deltaserve.tiny import make_tiny


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpt(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), family=request.param, preset="tiny", seed=11)


def budget_for(llm_cfg, num_seqs: int, num_pages: int, page_size: int, dtype=torch.float32) -> int:
    tail, state = kda_shapes(llm_cfg)
    slot = KdaStatePool.bytes_per_slot(len(llm_cfg.kda_layer_ids), tail, state, dtype, torch.float32)
    page = MlaPagePool.bytes_per_page(len(llm_cfg.mla_layer_ids), page_size, llm_cfg.mla.latent_dim, dtype)
    return num_seqs * slot + num_pages * page


def make_llm(ckpt, num_pages=64, page_size=4, max_num_seqs=6, max_num_batched_tokens=23, max_model_len=96, **kw) -> LLM:
    from deltaserve.model.config import ModelConfig

    cfg = ModelConfig.from_pretrained(ckpt)
    kw.setdefault("enable_prefix_caching", False)  # the budget is exact pages and live slots, no checkpoints
    return LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        page_size=page_size,
        kv_cache_memory=budget_for(cfg, max_num_seqs, num_pages, page_size),
        max_model_len=max_model_len,
        progress=False,
        **kw,
    )


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.forward_full(torch.tensor(ids)).argmax(-1)[-1]))
    return ids[len(prompt) :]


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def test_greedy_equals_reference_with_chunks_and_preemption(ckpt):
    llm = make_llm(ckpt, num_pages=30)
    prompts = random_prompts(llm.model.config.vocab_size, [5, 41, 17, 66, 3, 29, 52, 11], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["preemptions"] > 0, stats
    assert stats["computed_tokens"] > stats["prompt_tokens"] + stats["generated_tokens"] - len(prompts)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(llm.model, prompt, 10)
        assert out.outputs[0].finish_reason == "length" and out.finished
    llm.check_integrity()
    assert stats["mla_pages_used"] == 0 and stats["kda_slots_used"] == 0


def test_seeded_request_is_batch_invariant(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=64)
    vocab = llm.model.config.vocab_size
    target = random_prompts(vocab, [13], seed=2)[0]
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], sampled, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(vocab, [30, 7, 19], seed=3)
    mix = [
        SamplingParams(temperature=0.8, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=1.3, seed=7, max_tokens=14),
    ]
    outs = llm.generate([others[0], target, others[1], others[2]], [mix[0], sampled, mix[1], mix[2]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert len(set(alone)) > 3, "sampling engaged"
    llm.check_integrity()


def test_n_samples_and_text(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    out = llm.generate(
        "hello world", SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True, logprobs=2), use_tqdm=False
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert out.prompt_token_ids == tok.encode("hello world", allow_special=True)
    for o in out.outputs:
        assert len(o.token_ids) == 6 and len(o.logprobs) == 6
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
        assert all(t in lp for t, lp in zip(o.token_ids, o.logprobs))
        assert o.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)))
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_random_aborts_free_everything(ckpt):
    llm = make_llm(ckpt, num_pages=30)
    engine = llm.engine
    rng = random.Random(4)
    prompts = random_prompts(llm.model.config.vocab_size, [rng.randrange(2, 60) for _ in range(12)], seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 15)))
    finished, aborted = set(), set()
    while engine.has_unfinished():
        for out in engine.step():
            finished.add(out.request_id)
        llm.check_integrity()
        live = sorted(engine.requests)
        if live and rng.random() < 0.3:
            rid = rng.choice(live)
            out = engine.abort_request(rid)
            assert out.outputs[0].finish_reason == "abort"
            aborted.add(rid)
            llm.check_integrity()
    assert aborted and finished and len(finished | aborted) == 12
    stats = llm.stats()
    assert stats["mla_pages_used"] == 0 and stats["kda_slots_used"] == 0
    assert engine.abort_request("nonexistent") is None


def test_invalid_requests_rejected_and_engine_keeps_serving(ckpt):
    llm = make_llm(ckpt, max_model_len=40)
    vocab = llm.model.config.vocab_size
    good = random_prompts(vocab, [8], seed=6)[0]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([good, [1] * 41], SamplingParams(max_tokens=3), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([[vocab]], use_tqdm=False)
    for bad in (
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(max_tokens=0),
        dict(n=0),
        dict(repetition_penalty=0.0),
        dict(stop=[""]),
        dict(top_k=-2),
    ):
        with pytest.raises(ValueError):
            llm.generate([good], SamplingParams(**bad), use_tqdm=False)
    assert llm.stats()["requests_added"] == 0, "nothing from a rejected call was queued"
    out = llm.generate([good], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"
    assert len(good) + len(out[0].outputs[0].token_ids) == 40, "generation stops at max_model_len"
    llm.check_integrity()


def test_stop_token_and_stop_string(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    prompt = random_prompts(llm.model.config.vocab_size, [12], seed=8)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids == free.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    text = free.text
    needle = next(
        text[i : i + 2]
        for i in range(len(text) // 2, len(text) - 1)
        if text[i : i + 2].isprintable() and not text[i : i + 2].isspace() and "\ufffd" not in text[i : i + 2]
    )
    by_str = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=[needle], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == needle
    assert by_str.text == text[: text.index(needle)]
    with pytest.raises(ValueError):
        LLM(
            ckpt, dtype="float32", skip_tokenizer_init=True, max_model_len=32, kv_cache_memory=10**7, progress=False
        ).generate([prompt], SamplingParams(stop=["x"]), use_tqdm=False)
    assert tok is not None


def test_skip_tokenizer_init_token_prompts(ckpt, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("tiktoken.model", "tokenizer_config.json"))
    llm = LLM(
        bare, dtype=torch.float32, skip_tokenizer_init=True, max_model_len=32, kv_cache_memory=10**7, progress=False
    )
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_greedy(llm.model, [5, 6, 7], 4)
    assert out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text"], use_tqdm=False)


def test_bf16_model_and_bf16_state_pool(ckpt):
    """bf16 weights/activations with a bf16 KDA state pool: the pools take the dtypes asked for,
    and the first greedy token (a pure prefill) equals the bf16 no-cache reference."""
    from deltaserve.model.config import ModelConfig

    cfg = ModelConfig.from_pretrained(ckpt)
    llm = LLM(
        ckpt,
        dtype="bfloat16",
        kv_state_dtype=torch.bfloat16,
        max_num_seqs=2,
        page_size=4,
        kv_cache_memory=budget_for(cfg, 2, 40, 4),
        max_model_len=64,
        progress=False,
    )
    assert llm.cache.kda.states.dtype == torch.bfloat16 and llm.cache.mla.storage.dtype == torch.bfloat16
    prompts = random_prompts(cfg.vocab_size, [9, 21], seed=12)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids[0] == reference_greedy(llm.model, p, 1)[0]
        assert len(o.outputs[0].token_ids) == 5
    llm.check_integrity()


def test_logit_hidden_skips_the_gather_only_for_every_row_in_order():
    from types import SimpleNamespace

    from deltaserve.engine.exec.step_batch import every_row, logit_hidden

    hidden = torch.arange(12.0).view(4, 3)
    for rows, same in (([0, 1, 2, 3], True), ([0, 1, 3], False), ([1, 0, 2, 3], False), ([3], False)):
        step = SimpleNamespace(logit_rows=rows)
        got = logit_hidden(hidden, step, SimpleNamespace(logit_rows=torch.tensor(rows)))
        assert (got is hidden) == same == every_row(step, 4) and torch.equal(got, hidden[rows])
