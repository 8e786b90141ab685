"""`build_engine(config)`: model, tokenizer, cache layout, pools and `EngineCore` from one
`EngineConfig`, in the order start-up needs (used by `LLM` and, through it, the server).

Invariants: the native CPU kernels (bf16 only) are built and loaded before the pools are sized,
so no request pays for the compile; the cache's producer fingerprint names the kernel backend
("cpu-native" or "torch"), so checkpoints made by one backend never restore into the other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cache import CacheLayout, CacheManager, build_pools, size_layout
from ..cache.checkpoint_policy import CheckpointPolicy
from ..model import KimiForCausalLM, load_model, resolve_dtype
from ..model.tokenizer import Tokenizer
from ..ops.select import describe
from .config import EngineConfig
from .core import EngineCore

log = logging.getLogger(__name__)


@dataclass
class Engine:
    """The parts of a started engine; `core` runs requests over `cache`."""

    config: EngineConfig
    model: KimiForCausalLM
    tokenizer: Tokenizer | None
    layout: CacheLayout
    cache: CacheManager
    core: EngineCore
    max_model_len: int
    kernel: str


def build_engine(config: EngineConfig) -> Engine:
    c = config
    if c.num_threads is not None:
        torch.set_num_threads(c.num_threads)
    dtype = resolve_dtype(c.dtype)
    model = load_model(c.model, dtype=dtype, device=c.device, progress=c.progress, moe_weights=c.moe_weights)
    tokenizer = None if c.skip_tokenizer_init else Tokenizer.from_pretrained(c.model)
    cfg = model.config
    max_model_len = c.max_model_len or cfg.max_position_embeddings
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    policy = CheckpointPolicy.parse(c.kda_checkpoint_policy, c.prefix_match_unit, c.kda_checkpoint_interval)
    layout = size_layout(
        cfg,
        c.kv_cache_memory,
        c.max_num_seqs,
        max_model_len,
        c.page_size,
        dtype,
        resolve_dtype(c.kv_state_dtype),
        c.checkpoint_fraction if c.enable_prefix_caching else 0.0,
    )
    model_id = f"{Path(c.model).resolve()}:{dtype}"
    kernel = model.ops.name  # load_model bound the backend (and built the native kernels) once
    log.info("kernel backend: %s (%s on %s): %s", kernel, dtype, c.device, describe(model.ops))
    cache = CacheManager(*build_pools(cfg, layout, c.device), policy=policy, model_id=model_id, kernel=kernel)
    core = EngineCore(
        model,
        tokenizer,
        cache,
        max_num_seqs=c.max_num_seqs,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=max_model_len,
        seed=c.seed,
        structured_thinking_budget=c.structured_thinking_budget,
    )
    return Engine(c, model, tokenizer, layout, cache, core, max_model_len, kernel)
