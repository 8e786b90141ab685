"""A bf16 CPU-native server of a model whose MLA heads lie outside the native decode kernel's window:
its start-up line says the decode runs over gathered rows, each such decode call counts a
fallback, and `/metrics` exports exactly the engine's count as `deltaserve:kernel_fallbacks_total`."""

from __future__ import annotations

import dataclasses
import logging

import httpx
import pytest

from deltaserve import LLM
from deltaserve.kernels.cpu import MLA_MAX_HEADS, library
from deltaserve.ops import fallbacks
from deltaserve.server.app import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.tiny import PRESETS, make_tiny
from tests.server.live_server import run_app

parser = pytest.importorskip("prometheus_client.parser")
pytestmark = pytest.mark.skipif(library.native() is None, reason="native CPU kernels unavailable")
HEADS = MLA_MAX_HEADS + 8


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        m.setitem(PRESETS, ("kimi_k3", "wide"), dataclasses.replace(PRESETS[("kimi_k3", "tiny")], mla_heads=HEADS))
        return make_tiny(tmp_path_factory.mktemp("wide") / "k3", "kimi_k3", "wide", seed=3)


def _fallback_samples(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "deltaserve:kernel_fallbacks_total":
                out[s.labels["op"], s.labels["reason"]] = s.value
    return out


def test_outside_the_window_counts_and_shows_in_metrics(wide, caplog):
    with caplog.at_level(logging.INFO, logger="deltaserve"):
        llm = LLM(wide, "bfloat16", max_num_seqs=2, kv_cache_memory=16 * 2**20, max_model_len=256, progress=False)
    assert llm.model.ops.name == "cpu-native"
    line = next(r.message for r in caplog.records if r.message.startswith("kernel backend"))
    assert f"decode on flash kernel over gathered rows: {HEADS} heads" in line or "decode on torch" in line, line
    engine = AsyncEngine(llm.engine, llm.model.config.family)
    try:
        with run_app(build_app(engine, "wide")) as url:
            before = fallbacks.snapshot()
            body = {"model": "wide", "prompt": list(range(5, 25)), "max_tokens": 4, "ignore_eos": True}
            assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200
            counted = fallbacks.since(before)
            text = httpx.get(url + "/metrics", timeout=30).text
    finally:
        engine.shutdown()
    mla_layers = len(llm.model.config.mla_layer_ids)
    assert counted == {("mla_decode", "shape"): 3 * mla_layers}  # the 3 decode steps after the prefill
    exported = _fallback_samples(text)
    assert exported == {k: float(v) for k, v in fallbacks.snapshot().items()}
    assert exported[("mla_decode", "shape")] >= 3 * mla_layers
