"""Images through the engine (issue 19): the text model fed projector rows at `<|media_pad|>`
positions equals the float64-reference vision rows placed there; prefix caching keys units on
image digests (same image re-sent hits, another image of the same size never hits past the text
before it); the encoder cache encodes an image once; a span split over chunks changes nothing;
bad image requests are refused; two tensor-parallel ranks generate what one process does."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from deltaserve import LLM, SamplingParams
from deltaserve.cache.hashing import extend_hashes
from deltaserve.engine.exec.encoder_cache import EncoderCache
from deltaserve.engine.exec.messages import EmbedRows, Step, TensorBytes, decode, encode
from deltaserve.engine.request.mm_inputs import pad_runs, placeholders_to_pads
from deltaserve.engine.request.multimodal import image_input
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.model.context import ForwardContext
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.model.vision_weights import PREFIXES, load_vision_model
from deltaserve.ops.reference.vision import naive_vision
from deltaserve.tiny import PRESETS, make_tiny

from ...parallel.engine_fixtures import WIDE, make_llm

FP32_EPS = torch.finfo(torch.float32).eps
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3mm"), "kimi_k3", "tiny", seed=11)


@pytest.fixture(scope="module")
def proc(ckpt):
    return ImageProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def llm(ckpt):
    return make(ckpt)


def make(ckpt, prefix=False, **kw) -> LLM:
    opts = dict(max_num_seqs=4, max_num_batched_tokens=256, page_size=4, kv_cache_memory=40_000_000)
    opts |= dict(max_model_len=256, progress=False, enable_prefix_caching=prefix)
    return LLM(ckpt, dtype="float32", **(opts | kw))


def picture(seed: int, w: int = 84, h: int = 112) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def text_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(30, 1700) for _ in range(n)]


def pad_id(tok) -> int:
    return tok.special_tokens["<|media_pad|>"]


def ref_logits(model, ckpt, ids: list[int], images) -> torch.Tensor:
    """Last-position logits of the text model fed `naive_vision`'s float64 rows at the pad runs."""
    weights = {}
    for f in set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()):
        weights.update({k: v.double() for k, v in load_file(ckpt / f).items() if k.startswith(PREFIXES)})
    heads = json.loads((ckpt / "config.json").read_text())["vision_config"]["vt_num_attention_heads"]
    t = torch.tensor(ids)
    with torch.inference_mode():
        h = model.model.embed_tokens(t).clone()
        starts, ends = pad_runs(ids, pad_id(Tokenizer.from_pretrained(ckpt)))
        for s, e, im in zip(starts, ends, images):
            rows = naive_vision(weights, im.image.pixel_values.double(), [im.image.grid_thw], heads, FP32_EPS, 1e-5)
            h[s:e] = rows["out"].float()
        hidden = model.model(t, ForwardContext.single(len(ids), t.device), inputs_embeds=h)
        return model.compute_logits(hidden)[-1]


def captured_logits(llm, monkeypatch, prompts) -> tuple[torch.Tensor, list]:
    """The engine's logits of the first sampling step, and the outputs (one token each)."""
    calls = []
    orig = llm.model.compute_logits

    def capture(hidden):
        out = orig(hidden)
        calls.append(out)
        return out

    monkeypatch.setattr(llm.model, "compute_logits", capture)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    monkeypatch.undo()
    return calls[0], outs


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_logits_equal_reference_rows_at_pad_positions(ckpt, llm, proc, tok, monkeypatch):
    a, b, c = (image_input(picture(s, w, h), proc) for s, w, h in ((1, 84, 112), (2, 56, 56), (3, 140, 84)))
    assert (a.image.num_tokens, b.image.num_tokens, c.image.num_tokens) == (12, 4, 15)
    pad = pad_id(tok)
    one = text_ids(1, 9) + [pad] + text_ids(2, 7)  # a lone pad: the engine expands the block
    two = text_ids(3, 5) + b.image.prompt_ids(tok) + text_ids(4, 3) + [pad] + text_ids(5, 4)  # expanded + lone
    packed, outs = captured_logits(
        llm,
        monkeypatch,
        [
            {"prompt_token_ids": one, "multi_modal_data": {"image": a}},
            {"prompt_token_ids": two, "multi_modal_data": {"image": [b, c]}},
        ],
    )
    assert packed.shape[0] == 2  # both requests sampled in one step
    ids = [o.prompt_token_ids for o in outs]
    assert ids[0] == text_ids(1, 9) + a.image.prompt_ids(tok) + text_ids(2, 7)
    assert ids[1] == text_ids(3, 5) + b.image.prompt_ids(tok) + text_ids(4, 3) + c.image.prompt_ids(tok) + text_ids(
        5, 4
    )
    for got, p, images in zip(packed, ids, ([a], [b, c])):
        want = ref_logits(llm.model, ckpt, p, images)
        assert rel(got, want) < 2e-5
        with torch.inference_mode():  # the rows matter: pad embeddings give other logits
            plain = llm.model.forward_full(torch.tensor(p))[-1]
        assert rel(plain, want) > 1e-2
    alone, _ = captured_logits(llm, monkeypatch, [{"prompt_token_ids": one, "multi_modal_data": {"image": a}}])
    assert rel(alone[0], packed[0]) < 1e-5


def test_text_prompt_with_pil_images_matches_token_form(llm, tok):
    img = picture(7)
    text = "look <|media_pad|> and tell"
    by_text = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)[0]
    ids = tok.encode(text, allow_special=True)
    by_ids = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [img]}}, GREEDY, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids and len(by_ids.prompt_token_ids) > len(ids) + 12
    llm.check_integrity()


def _prompt(tok, pre, im, post) -> list[int]:
    return pre + im.image.prompt_ids(tok) + post


def test_prefix_cache_keys_on_image_digests(ckpt, proc, tok):
    a, a2, b = (image_input(picture(s), proc) for s in (11, 11, 12))
    assert a.digest == a2.digest != b.digest and a.image.num_tokens == b.image.num_tokens
    pre, post = text_ids(21, 20), text_ids(22, 30)
    runs = [  # (name, prompt ids, images)
        ("first", _prompt(tok, pre, a, post), [a]),
        ("same image again", _prompt(tok, pre, a2, post), [a2]),
        ("other image", _prompt(tok, pre, b, post), [b]),
        ("same image, other text", _prompt(tok, text_ids(23, 20), a, post), [a]),
    ]
    span = pad_runs(runs[0][1], pad_id(tok))
    start, end = int(span[0][0]), int(span[1][0])
    kw = dict(prefix_match_unit=16, kda_checkpoint_interval=16, checkpoint_fraction=0.4)
    on, off = make(ckpt, prefix=True, **kw), make(ckpt)
    deltas = {}
    for name, ids, images in runs:
        before = on.stats()
        got = on.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
        want = off.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, name
        after = on.stats()
        deltas[name] = {k: after[k] - before[k] for k in ("encoder_cache_hits", "encoder_cache_misses")} | {
            "hit_tokens": after["prefix_cache"]["hit_tokens"] - before["prefix_cache"]["hit_tokens"]
        }
        on.check_integrity()
    assert deltas["first"] == {"encoder_cache_hits": 0, "encoder_cache_misses": 1, "hit_tokens": 0}
    # the image's units were cached with its digest: the hit runs past the span, no encoding at all
    hit = deltas["same image again"]["hit_tokens"]
    assert hit >= end and deltas["same image again"]["encoder_cache_misses"] == 0
    # another image of the same size: only the text before the span hits, and it is encoded
    assert deltas["other image"] == {"encoder_cache_hits": 0, "encoder_cache_misses": 1, "hit_tokens": start // 16 * 16}
    # the same image after other text: no prefix hit, but the encoder cache has its rows
    assert deltas["same image, other text"] == {"encoder_cache_hits": 1, "encoder_cache_misses": 0, "hit_tokens": 0}
    assert off.stats()["encoder_cache_hits"] == 2  # cache off: the re-sent image's rows came from the encoder cache


def test_image_span_split_across_chunks(ckpt, proc, tok, llm):
    a, b = image_input(picture(31), proc), image_input(picture(32, 56, 56), proc)
    ids = text_ids(31, 6) + a.image.prompt_ids(tok) + text_ids(32, 3) + b.image.prompt_ids(tok) + text_ids(33, 5)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [a, b]}}
    want = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    small = make(ckpt, max_num_batched_tokens=5)
    got = small.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    stats = small.stats()
    assert got.token_ids == want.token_ids
    lp = [[d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] for o in (got, want)]
    assert max(abs(x - y) for x, y in zip(*lp)) < 1e-4
    # 12 + 4 pad positions over 5-token chunks: each image encoded once, looked up again per later chunk
    assert stats["encoder_cache_misses"] == 2 and stats["encoder_cache_hits"] >= 2
    assert stats["encoder_cache_encoded_tokens"] == 16


def test_bad_image_requests_are_refused(tmp_path, llm, proc, tok):
    a = image_input(picture(41), proc)
    pad, core, p = pad_id(tok), llm.engine, SamplingParams(max_tokens=2)
    cases = {
        "run of 5": [1, 2] + [pad] * 5 + [3],
        "0 <|media_pad|> run": [1, 2, 3],
        r"2 <\|media_pad\|> run": [1, pad, 2, pad, 3],
    }
    for match, ids in cases.items():
        with pytest.raises(InvalidRequestError, match=match):
            core.add_request("bad", ids, p, images=[a])
    with pytest.raises(InvalidRequestError, match="ImageInput"):
        core.add_request("bad", [1, pad], p, images=["not an image"])
    with pytest.raises(InvalidRequestError, match="multi_modal_data"):
        llm.generate({"prompt_token_ids": [1, pad], "multi_modal_data": {"video": [picture(1)]}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        core.add_request("bad", [1, pad] + [2] * 240, p, images=[a])
    assert not core.has_unfinished()
    kl = make(make_tiny(tmp_path / "kl", "kimi_linear", "tiny", seed=3), max_model_len=64)
    with pytest.raises(InvalidRequestError, match="no vision tower"):
        kl.engine.add_request("x", [1, 2, pad], p, images=[a])
    assert kl.stats()["encoder_cache_misses"] == 0


def test_k3_placeholder_reads_as_one_pad(llm, proc, tok, monkeypatch):
    assert placeholders_to_pads([5, 9, 6, 9], 9, 7) == [5, 7, 6, 7] and placeholders_to_pads([5, 9], None, 7) == [5, 9]
    a = image_input(picture(81), proc)
    core, placeholder = llm.engine, 1790  # a reserved id standing for <|kimi_image_placeholder|>
    monkeypatch.setattr(core.image_prompts, "placeholder_id", placeholder)
    core.add_request("ph", [3, placeholder, 4], SamplingParams(max_tokens=1), images=[a])
    out = core.abort_request("ph")
    assert out.prompt_token_ids == [3, *a.image.prompt_ids(tok), 4]


def test_prefix_hash_extra_keys_leave_text_chains_alone():
    tokens, root = list(range(48)), b"r" * 32
    plain = extend_hashes([], root, tokens, 16)
    assert extend_hashes([], root, tokens, 16, ((40, 48, b"far"),))[:2] == plain[:2]
    keyed = extend_hashes([], root, tokens, 16, ((20, 24, b"img"),))
    other = extend_hashes([], root, tokens, 16, ((20, 24, b"gmi"),))
    assert keyed[0] == plain[0] == other[0] and all(x != y != z for x, y, z in zip(keyed[1:], other[1:], plain[1:]))


def _encode_all(cache, images):
    cache.want(images)
    while cache.pending:
        cache.advance()
    return cache.rows(images)


def test_encoder_cache_is_bounded_lru(ckpt, proc):
    vision = load_vision_model(ckpt, torch.float32)
    a, b = image_input(picture(51), proc), image_input(picture(52), proc)
    size = a.image.num_tokens * vision.cfg.text_hidden_size * 4
    cache = EncoderCache(vision, max_bytes=size)
    both = _encode_all(cache, [a, b, a])  # both encoded and pinned while wanted
    with torch.inference_mode():
        alone = vision(a.image.pixel_values, [a.image.grid_thw])
    torch.testing.assert_close(both[a.digest], alone, rtol=1e-5, atol=1e-6)
    assert cache.stats()["encoder_cache_misses"] == 2 and cache.stats()["encoder_cache_hits"] == 0
    cache.want([])  # no longer wanted: unpinned into the LRU part, which holds one
    assert cache.bytes == size and list(cache.entries) == [b.digest] and cache.stats()["encoder_cache_evictions"] == 1
    cache.want([b])
    assert not cache.pending and cache.rows([b]) and cache.stats()["encoder_cache_hits"] == 1
    small = EncoderCache(vision, max_bytes=size - 1)
    assert _encode_all(small, [a])[a.digest].shape == alone.shape  # too big: used, not kept
    small.want([])
    assert not small.entries and small.bytes == 0


def test_step_carries_rows_as_typed_bytes():
    rows = torch.randn(3, 5).to(torch.bfloat16)
    step = Step([], [1, 2, 3], [0], [3], [[0]], [0], None, [], [2], EmbedRows([0, 2, 1], TensorBytes.of(rows)))
    back = decode(encode(step))
    assert back.embeds.index == [0, 2, 1] and torch.equal(back.embeds.rows.tensor(), rows)
    with pytest.raises(ValueError, match="bytes for"):
        TensorBytes("float32", [2, 2], b"\0" * 12).tensor()
    with pytest.raises(ValueError, match="dtype"):
        TensorBytes("int64", [1], b"\0" * 8).tensor()


def test_two_ranks_inject_the_image_rows_like_one_process(tmp_path, proc, tok):
    with pytest.MonkeyPatch.context() as m:
        m.setitem(PRESETS, ("kimi_k3", "tp"), dataclasses.replace(PRESETS[("kimi_k3", "tiny")], **WIDE))
        path = make_tiny(tmp_path / "k3tp", "kimi_k3", "tp", seed=7)
    a = image_input(picture(61), proc)
    ids = text_ids(61, 10) + a.image.prompt_ids(tok) + text_ids(62, 6)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": a}}
    outs = {}
    for tp in (1, 2):
        with make_llm(path, tp=tp, max_num_batched_tokens=16) as e:
            if tp == 1:  # no tokenizer: a lone pad cannot be expanded
                with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
                    e.engine.add_request("x", [1, pad_id(tok), 2], GREEDY, images=[a])
            outs[tp] = e.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[1] == outs[2]


def test_image_whose_pixels_do_not_fit_its_grid_is_refused(llm, proc, tok):
    a = image_input(picture(71), proc)
    bad = dataclasses.replace(a, image=dataclasses.replace(a.image, pixel_values=a.image.pixel_values[:-2]))
    with pytest.raises(InvalidRequestError, match="image 0: .*patches"):
        llm.engine.add_request("bad", [1, pad_id(tok), 2], GREEDY, images=[bad])
    assert not llm.engine.has_unfinished()
