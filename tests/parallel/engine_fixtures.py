"""Shared by the multi-process engine tests: tiny checkpoints whose sharded dims split in two,
and an `LLM` factory with one torch thread per rank (two ranks on a two-core machine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deltaserve.engine.llm import LLM
from deltaserve.tiny import PRESETS, make_tiny

WIDE = dict(kda_heads=4, mla_heads=4, moe_intermediate=128)
CHECKPOINTS = {  # name -> (family, MXFP4 experts on disk)
    "k3": ("kimi_k3", False),
    "k3_mx": ("kimi_k3", True),
    "kl": ("kimi_linear", False),
    "kl_mx": ("kimi_linear", True),
}


def write_checkpoints(root: Path) -> dict[str, Path]:
    with pytest.MonkeyPatch.context() as m:
        for family in ("kimi_k3", "kimi_linear"):
            m.setitem(PRESETS, (family, "tp"), dataclasses.replace(PRESETS[(family, "tiny")], **WIDE))
        return {n: make_tiny(root / n, fam, "tp", mxfp4=mx, seed=7) for n, (fam, mx) in CHECKPOINTS.items()}


def make_llm(path: Path, tp: int = 1, **kwargs) -> LLM:
    opts = dict(num_threads=1, skip_tokenizer_init=True, max_model_len=4096, progress=False)
    return LLM(path, kwargs.pop("dtype", "float32"), tensor_parallel_size=tp, **(opts | kwargs))
