"""A started `AsyncEngine` over a tiny random Kimi-Linear checkpoint (two sequences, 16 MiB of
cache): what the engine-thread contract tests drive directly, without HTTP."""

from __future__ import annotations

import contextlib
from pathlib import Path

from deltaserve import LLM
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.tiny import make_tiny


@contextlib.contextmanager
def tiny_async_engine(root: Path):
    ckpt = make_tiny(root / "kl", family="kimi_linear", preset="tiny", seed=0)
    llm = LLM(ckpt, dtype="float32", max_num_seqs=2, kv_cache_memory=16 * 2**20, max_model_len=128, progress=False)
    eng = AsyncEngine(llm.engine, llm.model.config.family)
    eng.start()
    try:
        yield eng
    finally:
        eng.shutdown()
