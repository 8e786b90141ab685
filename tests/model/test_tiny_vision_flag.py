"""`make-tiny --vision/--no-vision`: a K3 with the tower writes it in the real layout (config,
processor config, weights) and serves images; without it the text model is unchanged and images
are refused clearly; Kimi-Linear has no tower to ask for."""

import json

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from deltaserve import LLM, SamplingParams
from deltaserve.cli import main
from deltaserve.engine.request.sequence import InvalidRequestError
from deltaserve.model.image_processor import PROCESSOR_FILE


def _names(path) -> set[str]:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return set(index["weight_map"])


def _text_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out |= {k: sf.get_tensor(k) for k in sf.keys() if k.startswith("language_model.")}
    return out


def test_vision_flag(tmp_path, capsys):
    assert main(["make-tiny", "--family", "kimi_k3", "--out", str(tmp_path / "v")]) == 0
    assert main(["make-tiny", "--family", "kimi_k3", "--no-vision", "--out", str(tmp_path / "t")]) == 0
    with_v, text = tmp_path / "v", tmp_path / "t"
    vision = {n for n in _names(with_v) if n.startswith(("vision_tower.", "mm_projector."))}
    assert vision and _names(text) == _names(with_v) - vision
    assert (with_v / PROCESSOR_FILE).is_file() and not (text / PROCESSOR_FILE).exists()
    assert "vision_config" in json.loads((with_v / "config.json").read_text())
    assert "vision_config" not in json.loads((text / "config.json").read_text())
    a, b = _text_tensors(with_v), _text_tensors(text)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same text model
    image = Image.new("RGB", (28, 28), (200, 10, 10))
    prompt = {"prompt": "look <|media_pad|>", "multi_modal_data": {"image": image}}
    llm = LLM(text, "float32", max_model_len=512, progress=False)
    with pytest.raises(InvalidRequestError, match="vision"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    out = LLM(with_v, "float32", max_model_len=512, progress=False).generate(
        prompt, SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="only kimi_k3"):
        main(["make-tiny", "--family", "kimi_linear", "--vision", "--out", str(tmp_path / "kl")])
