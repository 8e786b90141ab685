"""The embedded default model is the trained small K3 shipped in the package: a K3 checkpoint in
the real layout (MXFP4 experts, a vision tower and its processor config), small enough to live in
the repository, with its training record; the Kimi-Linear one ships beside it."""

import json

import pytest

from deltaserve import serve
from deltaserve.model.config import ModelConfig
from deltaserve.model.image_processor import PROCESSOR_FILE, ImageProcessor
from deltaserve.tiny.shipped import shipped_model_dir

LIMIT = 25 << 20
# the budget is 2 hours on the machine's 2 cores; a run recorded with one torch thread is
# held to that budget at the measured two-thread speed-up (1.6x, docs/performance.md)
TWO_THREAD_SPEEDUP = 1.6


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_the_shipped_models(family):
    path = shipped_model_dir(family)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.family == family
    assert sum(f.stat().st_size for f in path.iterdir()) <= LIMIT
    record = json.loads((path / "training.json").read_text())
    assert record["config"]["family"] == family and record["steps"] == record["config"]["steps"]
    speedup = TWO_THREAD_SPEEDUP if record["machine"]["threads"] == 1 else 1.0
    assert record["train_seconds"] / speedup <= 2 * 3600
    if family == "kimi_k3":
        assert serve.default_model_dir() == path
        raw = json.loads((path / "config.json").read_text())
        assert "vision_config" in raw and raw["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
        assert (path / PROCESSOR_FILE).is_file() and ImageProcessor.from_pretrained(path).patch_size == 14
