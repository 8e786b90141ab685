"""`LLM.chat`: conversations rendered in the model's chat format give what `generate` gives on
the rendered ids (text and images; a PIL image and its data URL are one image); batches of
conversations; clear errors for what offline chat refuses."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from deltaserve import LLM, SamplingParams
from deltaserve.chat.render import load_chat_template, render_chat
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.tiny import make_tiny

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for family in ("kimi_k3", "kimi_linear"):
        path = make_tiny(root / family, family=family, preset="tiny", seed=5)
        out[family] = LLM(path, "float32", max_model_len=1024, progress=False)
    return out


def _image() -> Image.Image:
    g = torch.Generator().manual_seed(0)
    return Image.fromarray(torch.randint(0, 256, (30, 44, 3), generator=g, dtype=torch.uint8).numpy())


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_chat_is_generate_on_the_rendered_conversation(llms, family):
    llm = llms[family]
    convs = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "and you?"}]]
    template = load_chat_template(llm.config.model)
    ids = [render_chat(llm.tokenizer, family, c, chat_template=template) for c in convs]
    want = _tokens(llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False))
    assert _tokens(llm.chat(convs, GREEDY, use_tqdm=False)) == want
    assert _tokens(llm.chat(convs[0], GREEDY, use_tqdm=False)) == want[:1]


def test_chat_with_an_image_pil_or_data_url(llms):
    llm, image = llms["kimi_k3"], _image()
    text = {"type": "text", "text": "what is this?"}
    pil = [{"role": "user", "content": [text, {"type": "image_pil", "image_pil": image}]}]
    url = [{"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": _data_url(image)}}]}]
    rendered = render_chat(llm.tokenizer, "kimi_k3", [{"role": "user", "content": [text, {"type": "image_url"}]}])
    prompt = {"prompt_token_ids": rendered, "multi_modal_data": {"image": image}}
    want = _tokens(llm.generate(prompt, GREEDY, use_tqdm=False))
    before = llm.stats()["encoder_cache_misses"]
    assert _tokens(llm.chat(pil, GREEDY, use_tqdm=False)) == want
    assert _tokens(llm.chat(url, GREEDY, use_tqdm=False)) == want
    out = llm.chat(url, GREEDY, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > len(rendered) + 1  # the engine expanded the image's block
    assert llm.stats()["encoder_cache_misses"] == before  # one image, encoded once by generate


def test_chat_with_two_images_side_by_side(llms):
    """Two adjacent image parts render as two adjacent pads: each must still be its own image."""
    llm, a = llms["kimi_k3"], _image()
    b = a.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    conv = [{"role": "user", "content": [{"type": "image_pil", "image_pil": im} for im in (a, b)]}]
    out = llm.chat(conv, GREEDY, use_tqdm=False)[0]
    pad = llm.tokenizer.special_tokens["<|media_pad|>"]
    begin = llm.tokenizer.special_tokens["<|media_begin|>"]
    assert out.prompt_token_ids.count(begin) == 2 and len(out.outputs[0].token_ids) == 6
    n = ImageProcessor.from_pretrained(llm.config.model)(a).num_tokens
    assert out.prompt_token_ids.count(pad) == 2 * n


@pytest.mark.parametrize(
    "family, content, match",
    [
        ("kimi_k3", [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "data URLs"),
        ("kimi_k3", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "readable image"),
        ("kimi_k3", [{"type": "image_pil", "image_pil": "not an image"}], "PIL image"),
        ("kimi_linear", [{"type": "image_pil", "image_pil": _image()}], "image"),
    ],
)
def test_offline_chat_refuses_clearly(llms, family, content, match):
    with pytest.raises(InvalidRequestError, match=match):
        llms[family].chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    llms[family].check_integrity()
