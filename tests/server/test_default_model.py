"""The embedded default model cached before image input existed gets its processor config on
the next start (the rest of the checkpoint is kept as it is)."""

import json

from deltaserve import serve
from deltaserve.model.image_processor import PROCESSOR_FILE, ImageProcessor


def test_a_stale_default_model_gets_its_processor_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stale = serve.cache_dir() / serve.DEFAULT_NAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    assert serve.default_model_dir() == stale
    assert (stale / PROCESSOR_FILE).is_file() and ImageProcessor.from_pretrained(stale).patch_size == 14
    assert json.loads((stale / "config.json").read_text()) == {"model_type": "kimi_k3"}
