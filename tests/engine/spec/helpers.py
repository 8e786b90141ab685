"""Shared by the speculative decoding tests: a tiny checkpoint whose greedy outputs loop (so model-
free drafters get accepted), copy-heavy prompts, and engines with and without speculation."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltaserve import LLM
from deltaserve.model.config import ModelConfig
from deltaserve.tiny import make_tiny

from ..test_engine import budget_for


def loopy_tiny(out: Path, family: str, scale: float = 0.05, seed: int = 21, preset: str = "tiny") -> Path:
    """`make_tiny`, its lm_head replaced by `scale` x the embedding plus small noise: the head then
    favours the token just read, so greedy outputs mix runs of one token with breaks (a random
    tiny model's outputs do not repeat at all, so no drafter would ever be accepted)."""
    ckpt = make_tiny(out, family=family, preset=preset, seed=seed)
    files = sorted(Path(ckpt).glob("*.safetensors"))
    emb = next(v for f in files for k, v in load_file(f).items() if k.endswith("embed_tokens.weight"))
    noise = torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    for f in files:
        tensors = load_file(f)
        heads = [k for k in tensors if k.endswith("lm_head.weight")]
        for k in heads:
            tensors[k] = (emb.float() * scale + noise).to(tensors[k].dtype)
        if heads:
            save_file(tensors, f, metadata={"format": "pt"})
    return ckpt


def copy_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of a random passage followed by a repeat of part of it (an edit of a passage)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        base = [rng.randrange(vocab) for _ in range(n)]
        out.append(base + base[: rng.randrange(1, n + 1)])
    return out


def engine(
    ckpt, spec: dict | None, prefix: bool = True, num_pages: int = 80, max_num_seqs: int = 4, max_model_len=160, **kw
) -> LLM:
    """An fp32 engine (unless `dtype` says otherwise) with page 4 and unit 8 (small boundaries, so
    every path is crossed)."""
    cfg = ModelConfig.from_pretrained(ckpt)
    live = budget_for(cfg, max_num_seqs, num_pages, 4)
    ckpts = 12 * budget_for(cfg, 1, 0, 4) if prefix else 0
    kw.setdefault("max_num_batched_tokens", 29)
    kw.setdefault("dtype", "float32")
    return LLM(
        ckpt,
        max_num_seqs=max_num_seqs,
        page_size=4,
        kv_cache_memory=live + ckpts,
        max_model_len=max_model_len,
        progress=False,
        enable_prefix_caching=prefix,
        prefix_match_unit=8,
        checkpoint_fraction=ckpts / (live + ckpts) + 1e-9 if prefix else 0.25,
        speculative_config=spec,
        **kw,
    )
