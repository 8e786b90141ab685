"""What `deltaserve plan` adds to the text weights so that its figures are the engine's: the vision
tower, the encoder cache and the KV pools, each sized the way `build_engine` sizes it.

Invariants:
- The pools come from `budget.plan_layout` (a budget: `--memory-per-rank` less the reserve, the
  weights and the encoder cache) or `budget.workload_layout` (no budget: the engine's default when
  it fits the device), with the engine's dtypes: the MLA latent and the KDA conv tail in the model
  dtype, the KDA state in `--kv-state-dtype`. With prefix caching the checkpoint slots (and, for
  the default, the doubled MLA pages) are in them: the prefix-cache headroom.
- The vision tower (K3 whose `config.json` has a `vision_config`) and the encoder cache live on
  rank 0 only, so rank 0 is the largest rank and the per-rank figures are its.
- `EngineSettings()` equals `EngineConfig`'s defaults (tested): `cli` passes those in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import ConfigError, ModelConfig
from ..model.vision import VisionConfig, VisionModel
from ..parallel import ParallelContext
from .budget import CacheLayout, plan_layout, workload_layout


@dataclass(frozen=True)
class EngineSettings:
    """The engine flags that size memory beyond the layout (`EngineConfig`'s names)."""

    max_num_seqs: int = 16
    enable_prefix_caching: bool = True
    checkpoint_fraction: float = 0.25
    encoder_cache_memory: int = 512 << 20
    max_num_batched_tokens: int = 2048  # a prefill step's tokens (the wide-EP all-to-all's)


def load_vision_config(path: str | Path) -> VisionConfig | None:
    """The `vision_config` of a checkpoint directory's (or a bare) config.json, None without one."""
    path = Path(path)
    file = path if path.is_file() else path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: cannot read ({e})") from None
    return VisionConfig.from_dict(raw) if isinstance(raw, dict) and "vision_config" in raw else None


def vision_bytes(vision: VisionConfig | None, dtype: torch.dtype) -> int:
    """Bytes of the tower + projector in the model dtype (0 without a vision tower)."""
    if vision is None:
        return 0
    with torch.device("meta"):
        model = VisionModel(vision)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def engine_layout(
    cfg: ModelConfig,
    eng: EngineSettings,
    budget: int | None,
    max_model_len: int,
    page_size: int,
    dtypes: tuple[torch.dtype, torch.dtype],
    tp: int,
    dcp: int,
) -> CacheLayout | None:
    """The pools the engine builds on each rank for `budget` bytes (None: its default), or None
    where the budget cannot hold one `max_model_len` request."""
    ctx = ParallelContext(world=tp, dcp_world=dcp)
    fraction = eng.checkpoint_fraction if eng.enable_prefix_caching else 0.0
    args = (eng.max_num_seqs, max_model_len, page_size, *dtypes, fraction, ctx)
    if budget is None:
        return workload_layout(cfg, *args)
    try:
        return plan_layout(cfg, budget, *args)
    except ValueError:
        return None


def cache_section(layout: CacheLayout | None, budget: int | None, eng: EngineSettings) -> dict | None:
    """The JSON form of the pools (None where nothing fits)."""
    if layout is None:
        return None
    return {
        "sized_by": "workload" if budget is None else "budget",
        "kv_cache_memory": budget,
        "bytes": layout.total_bytes,
        "mla_pages": layout.num_pages,
        "mla_page_bytes": layout.page_bytes,
        "token_capacity": layout.token_capacity,
        "live_slots": layout.num_slots,
        "checkpoint_slots": layout.num_checkpoint_slots,
        "slot_bytes": layout.slot_bytes,
        "prefix_caching": eng.enable_prefix_caching,
        "checkpoint_fraction": eng.checkpoint_fraction if eng.enable_prefix_caching else 0.0,
    }


def engine_flags(p: dict, eng: EngineSettings, defaults: EngineSettings) -> str:
    """The `serve`/`generate` flags that make the engine allocate what plan `p` says."""
    lay, cache = p["layout"], p["cache"]
    flags = [f"--dtype {lay['dtype']}", f"--max-model-len {lay['max_model_len']}"]
    flags += [f"--max-num-seqs {eng.max_num_seqs}", f"--page-size {lay['page_size']}"]
    flags.append(f"--kv-state-dtype {lay['kv_state_dtype']}")
    if cache is not None and cache["kv_cache_memory"] is not None:
        flags.append(f"--kv-cache-memory {cache['kv_cache_memory']}")
    if eng.enable_prefix_caching != defaults.enable_prefix_caching:
        flags.append(f"--{'' if eng.enable_prefix_caching else 'no-'}enable-prefix-caching")
    if eng.enable_prefix_caching:
        flags.append(f"--checkpoint-fraction {eng.checkpoint_fraction}")
    if p["encoder_cache"]["bytes"]:
        flags.append(f"--encoder-cache-memory {eng.encoder_cache_memory}")
    if lay["tensor_parallel_size"] > 1:
        flags.append(f"--tensor-parallel-size {lay['tensor_parallel_size']}")
    if lay["decode_context_parallel_size"] > 1:
        flags.append(f"--decode-context-parallel-size {lay['decode_context_parallel_size']}")
    if lay["data_parallel_size"] > 1:
        flags.append(f"--data-parallel-size {lay['data_parallel_size']}")
    if lay["expert_parallel"]:
        flags.append("--enable-expert-parallel")
    return " ".join(flags)
