"""Vision within a memory bound and off the critical path (issue 44): a large image is encoded a
bounded share per step while a decoding request keeps getting a token every step, the text before
the image runs first, and the rows equal an unbounded encode's; the default budget is sized from
memory; a request's patch total is refused before any pixel is decoded; an encode's peak memory is
linear in its patches."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from deltaserve import LLM, SamplingParams
from deltaserve.engine.config import DEFAULT_MAX_IMAGE_PATCHES
from deltaserve.engine.exec.encoder_cache import REFERENCE_PATCHES, default_patches_per_step
from deltaserve.engine.request.mm_inputs import ImagePatchLimitError
from deltaserve.engine.request.multimodal import image_input
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.model.vision_weights import load_vision_model
from deltaserve.tiny import make_tiny
from deltaserve.tiny.presets import MEDIA_PROC_CFG

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3budget"), "kimi_k3", "tiny", seed=5)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_pretrained(ckpt)


def make(ckpt, **kw) -> LLM:
    opts = dict(max_num_seqs=4, max_num_batched_tokens=256, page_size=4, kv_cache_memory=40_000_000)
    return LLM(ckpt, dtype="float32", max_model_len=256, progress=False, **(opts | kw))


def picture(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_decodes_keep_stepping_while_a_large_image_encodes(ckpt, tok):
    """Budget 32 patches a step on a 256-patch image (16x16 grid, 2 tower blocks): the encode runs
    over exactly 8 steps of at most 32 * 2 (row, block) pairs; in each of them the decoding request
    gets its token; the image request's text before the image is computed in the first step, its
    image positions only once encoded; its output equals an engine's with an unbounded budget."""
    budget, llm = 32, make(ckpt, max_encoder_patches_per_step=32)
    core, enc = llm.engine, llm.engine.runner.encoder
    im = image_input(picture(1, 224, 224), ImageProcessor.from_pretrained(ckpt))
    assert im.image.pixel_values.shape[0] == 256 and enc.vision.cfg.num_layers == 2
    head = [7, 8, 9, 10, 11]
    ids = head + im.image.prompt_ids(tok) + [12, 13]
    start = len(head) + im.image.prompt_ids(tok).index(tok.special_tokens["<|media_pad|>"])
    core.add_request("dec", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    core.step()
    dec = core.requests["dec"].seqs[0]
    core.add_request("img", ids, GREEDY, images=[im])
    seq = core.requests["img"].seqs[0]
    spent, tokens, computed = [], [], []
    real = enc.advance
    enc.advance = lambda *a: spent.append(real(*a)) or spent[-1]
    while enc.pending or not spent:
        n = len(dec.output_ids)
        core.step()
        tokens.append(len(dec.output_ids) - n)
        computed.append(seq.num_computed)
    assert spent == [budget * 2] * 8 and len(spent) == math.ceil(256 / budget)
    assert tokens == [1] * 8  # the decode stepped in every step of the encode
    assert computed == [start] * 8  # the text before the image ran, the image's positions waited
    while core.has_unfinished():
        core.step()
    unbounded = make(ckpt, max_encoder_patches_per_step=10**6)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [im]}}
    want = unbounded.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    assert max(abs(g[t].logprob - w[t].logprob) for g, w, t in zip(got.logprobs, want.logprobs, got.token_ids)) < 1e-4


def test_aborting_a_request_stops_its_encode(ckpt, tok):
    llm = make(ckpt, max_encoder_patches_per_step=16)
    core, enc = llm.engine, llm.engine.runner.encoder
    im = image_input(picture(2, 224, 224), ImageProcessor.from_pretrained(ckpt))
    core.add_request("img", [7] + im.image.prompt_ids(tok), GREEDY, images=[im])
    core.step()
    assert enc.pending
    core.abort_request("img")
    core.step()
    assert not enc.pending and not enc.pinned and enc.stats()["encoder_cache_encoded_tokens"] == 0


def test_patch_total_is_refused_before_pixels_are_decoded(ckpt, tok, monkeypatch):
    """Offline: images whose sizes give more patches than `max_image_patches_per_request` are a
    typed `ValueError` naming the limit, raised before preprocessing; the engine refuses the same
    total of preprocessed images. The default admits four 3000x3000 photos."""
    llm = make(ckpt, max_image_patches_per_request=300)
    pad = tok.special_tokens["<|media_pad|>"]
    pictures = [picture(3, 224, 224), picture(4, 56, 56)]  # 256 + 16 patches: fits
    ok = {"prompt_token_ids": [1, pad, 2, pad, 3], "multi_modal_data": {"image": pictures}}
    assert llm.generate(ok, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    over = {"prompt_token_ids": [1, pad, 2, pad, 3], "multi_modal_data": {"image": pictures[:1] * 2}}
    monkeypatch.setattr("deltaserve.engine.llm.image_input", lambda *a: pytest.fail("decoded"))
    with pytest.raises(ImagePatchLimitError, match=r"512 vision patches; at most 300 .*--max-image-patches"):
        llm.generate(over, GREEDY, use_tqdm=False)
    assert issubclass(ImagePatchLimitError, ValueError) and issubclass(ImagePatchLimitError, InvalidRequestError)
    a = image_input(pictures[0], ImageProcessor.from_pretrained(ckpt))
    with pytest.raises(ImagePatchLimitError, match="at most 300"):
        llm.engine.add_request("x", [1, pad, 2, pad], GREEDY, images=[a, a])
    assert not llm.engine.has_unfinished()
    proc = ImageProcessor(MEDIA_PROC_CFG)
    assert 4 * proc.num_patches(3000, 3000) <= DEFAULT_MAX_IMAGE_PATCHES
    assert 4 * proc.num_tokens(3000, 3000) < 200_000


_PEAK = textwrap.dedent(
    """
    import json, sys, torch
    from deltaserve.engine.exec.encoder_cache import EncoderCache
    from deltaserve.engine.request.multimodal import ImageInput
    from deltaserve.model.image_processor import ProcessedImage
    from deltaserve.model.vision_weights import load_vision_model

    side, ckpt, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    vision = load_vision_model(ckpt, torch.bfloat16)
    pixels = torch.randn(side * side, 3, 14, 14)
    im = ImageInput(ProcessedImage(pixels, (1, side, side), side * side // 4, (side * 14, side * 14)), b"x")

    def hwm():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024

    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

    with torch.inference_mode():
        vision(pixels[:16], [(1, 4, 4)])  # warm up the kernels
    if how == "engine":
        cache = EncoderCache(vision, patches_per_step=1024)
        cache.want([im])
    base = rss()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    if how == "engine":
        while cache.pending:
            cache.advance()
        rows = cache.rows([im])[b"x"]
    else:
        with torch.inference_mode():
            rows = vision(pixels, [(1, side, side)])
    assert rows.shape[0] == side * side // 4
    print(json.dumps({"peak": hwm() - base}))
    """
)


def _encode_peak(ckpt, side: int, how: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK, str(side), str(ckpt), how], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.parametrize("how", ["engine", "forward"])
def test_encode_peak_memory_is_linear_in_patches(ckpt, how):
    """Peak RSS growth of a fresh process encoding one image (through `EncoderCache` as the engine
    does, or one `VisionModel` call), from `/proc/self/status` VmHWM after resetting it: 4x the
    patches costs at most ~4x the memory plus a few MiB (a quadratic path, e.g. a dense mask or a
    full score matrix, grows 16x: 1024 -> 4096 patches would add ~130 MiB of fp32 scores)."""
    small, large = (_encode_peak(ckpt, side, how) for side in (32, 64))
    per_patch = 4096  # bytes: the tiny tower's bound per patch (docs/performance.md)
    assert large - small <= (64 * 64 - 32 * 32) * per_patch + (8 << 20), (small, large)
    assert large <= 4 * small + (8 << 20), (small, large)


def test_default_budget_is_sized_from_memory(ckpt):
    """The default patches per step: one step's chunk working set (activations plus fp32 scores
    against a 65536-patch image on every head) within 1/256 of the memory, clamped."""
    vision = load_vision_model(ckpt, "bfloat16")
    per_patch = vision.cfg.patch_bytes + 4 * REFERENCE_PATCHES * vision.cfg.num_heads
    assert per_patch == 4 * (3 * 32 + 4 * 48 + 2 * 64) + 4 * 65536 * 2
    assert default_patches_per_step(vision, 256 * per_patch * 300) == 300
    assert default_patches_per_step(vision, 256 * per_patch * 300 - 1) == 299
    assert default_patches_per_step(vision, 1 << 20) == 64 and default_patches_per_step(vision, 1 << 50) == 8192
