"""Memory plan per rank for a parallel layout, from `config.json` alone (spec/serving.md §1.1-1.3).

Layout: the engine's (vLLM's): a replica spans TP ranks and the DCP group is carved out of them
(DCP divides TP). Attention and KDA heads, the dense MLP, shared experts and the vocabulary
(embedding, `lm_head`) split TP-ways; MLA latent KV, which plain TP replicates, is sharded by
position across DCP (a rank holds ceil(L / DCP) of L tokens). Routed experts split by width
TP-ways, or with expert parallelism by whole experts (E / TP per rank). With data parallelism
(`dp` D replicas, each its own TP group and caches) everything is per replica as above, except
that wide expert parallelism (`ep` with D > 1) splits the routed experts over all D x TP ranks,
and the plan adds each rank's all-to-all bytes per step and, at TP > 1, the all-gather of the
routed rows inside a replica (`plan_ep`).

Weights are counted from the model's own parameter shapes (`KimiForCausalLM` built on the meta
device: no checkpoint needed): bf16 (2 B), routed experts MXFP4 at 4.25 bits per weight
(packed nibbles + one E8M0 scale per 32) when `quantization_config` says so. What splits under
TP is what the tensor-parallel model itself shards (`parallel.shard` marks); the rest (norms,
AttnRes projections, the router, the low-rank `*_a` projections, K3's latent MoE projections)
is replicated.

KDA state per request: `budget.unit_bytes` on the per-rank head count (H / TP: the DCP group's
ranks hold different heads, so DCP shrinks the MLA part of a request only), conv tail in the
model dtype. The MLA latent is in the model dtype too: the engine has no fp8 KV cache, so
`--kv-cache-dtype fp8` (or any dtype but the model's) is refused.

A request of L tokens costs one KDA slot plus ceil(ceil(L / DCP) / page) MLA pages per rank. Rank
0 also holds the vision tower and the encoder cache (`plan_engine`); the KV budget is memory per
rank - a reserve (activations, graphs, allocator: a fraction) - rank 0's weights - the encoder
cache, split into pools exactly as the engine splits `--kv-cache-memory` (prefix-cache
checkpoint slots included).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import torch

from ..model.config import ConfigError, ModelConfig
from ..model.vision import VisionConfig
from .budget import CacheLayout, unit_bytes
from .plan_engine import EngineSettings, cache_section, engine_flags, engine_layout, vision_bytes
from .plan_ep import all_to_all

GROUPS = ("attention_dense", "shared_experts", "routed_experts", "embeddings")
MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
KV_DTYPES = ("auto", "bfloat16", "float32", "fp8")  # accepted by the flag; only the model dtype plans
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MXFP4_BITS_PER_WEIGHT = Fraction(4 * 32 + 8, 32)  # E2M1 nibbles + one E8M0 byte per 32: 4.25
SHORT_LENGTHS = (8192, 32768, 131072)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class PlanError(ValueError):
    """A layout the model cannot take (the message names the flag)."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dcp: int = 1
    ep: bool = False
    kv_dtype: str = "auto"  # the engine's KV cache is the model dtype: "auto" or that dtype
    state_dtype: str = "float32"
    page_size: int = 16
    dtype: str = "bfloat16"  # weights, activations, MLA latent and KDA conv tail
    dp: int = 1  # data-parallel replicas

    @property
    def torch_dtype(self) -> torch.dtype:
        return MODEL_DTYPES[self.dtype]

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    @property
    def wide_ep(self) -> bool:
        """Routed experts split over every replica's ranks (all-to-all dispatch)."""
        return self.ep and self.dp > 1

    @property
    def expert_ranks(self) -> int:
        """Ranks the routed experts are split over by whole experts (1: not split by expert)."""
        return self.ranks if self.wide_ep else self.tp if self.ep else 1


def parse_bytes(text: str) -> int:
    """'141GiB', '288 GB', '1.5TiB' or plain bytes -> bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a positive size: {text!r} (e.g. 141GiB, 288GB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def load_config(path: str | Path) -> ModelConfig:
    """A checkpoint directory or a bare config JSON file."""
    path = Path(path)
    if not path.is_file():
        return ModelConfig.from_pretrained(path)
    try:
        return ModelConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


@functools.lru_cache(maxsize=4)
def weight_census(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Group -> (elements split under TP, elements replicated), from the meta-device model: a
    parameter the model marks with `parallel.shard` splits, every other one is replicated."""
    from ..model.kimi import KimiForCausalLM

    with torch.device("meta"):
        model = KimiForCausalLM(cfg)
    out = {g: [0, 0] for g in GROUPS}
    for name, t in model.named_parameters():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        group = (
            "routed_experts"
            if ".block_sparse_moe.experts." in name
            else "shared_experts"
            if ".shared_experts." in name
            else "embeddings"
            if name in ("model.embed_tokens.weight", "lm_head.weight")
            else "attention_dense"
        )
        out[group][0 if hasattr(t, "tp_dim") else 1] += t.numel()
    return {g: (split, rep) for g, (split, rep) in out.items()}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check(cfg: ModelConfig, lay: Layout) -> None:
    for flag, v in (
        ("--tensor-parallel-size", lay.tp),
        ("--decode-context-parallel-size", lay.dcp),
        ("--page-size", lay.page_size),
        ("--data-parallel-size", lay.dp),
    ):
        if v < 1:
            raise PlanError(f"{flag} must be >= 1, got {v}")
    for what, heads in (("KDA", cfg.kda.num_heads), ("MLA", cfg.mla.num_heads)):
        if heads % lay.tp:
            raise PlanError(f"--tensor-parallel-size {lay.tp} does not divide the {heads} {what} heads")
    if lay.tp % lay.dcp:
        raise PlanError(f"--decode-context-parallel-size {lay.dcp} must divide --tensor-parallel-size {lay.tp}")
    if lay.wide_ep and lay.dcp > 1:
        raise PlanError(
            "--data-parallel-size with --enable-expert-parallel (wide EP): the engine runs no "
            "--decode-context-parallel-size there"
        )
    if lay.ep and cfg.moe.num_experts % lay.expert_ranks:
        where = f"DP{lay.dp} x TP{lay.tp} ranks" if lay.wide_ep else f"TP{lay.tp}"
        raise PlanError(f"--enable-expert-parallel: {cfg.moe.num_experts} experts do not split over {where}")
    if lay.dcp > 1 and not cfg.mla_layer_ids:
        raise PlanError("--decode-context-parallel-size shards MLA KV by position, and this model has no MLA layers")
    if lay.dtype not in MODEL_DTYPES or lay.kv_dtype not in KV_DTYPES or lay.state_dtype not in STATE_DTYPES:
        raise PlanError(
            f"unknown dtype: model {lay.dtype!r} (one of {sorted(MODEL_DTYPES)}), kv {lay.kv_dtype!r} "
            f"(one of {list(KV_DTYPES)}), state {lay.state_dtype!r} (one of {sorted(STATE_DTYPES)})"
        )
    if lay.kv_dtype == "fp8":
        raise PlanError(
            "--kv-cache-dtype fp8: the engine has no fp8 KV cache (it keeps the MLA latent in the model "
            "dtype, --dtype bfloat16 or float32); plan without it"
        )
    if lay.kv_dtype not in ("auto", lay.dtype):
        raise PlanError(
            f"--kv-cache-dtype {lay.kv_dtype}: the engine keeps the KV cache in the model dtype "
            f"(--dtype {lay.dtype}); give auto or {lay.dtype}"
        )


def weight_bytes(cfg: ModelConfig, lay: Layout, vision: VisionConfig | None = None) -> dict[str, dict[str, int]]:
    """Group -> {"per_rank", "total"} bytes (see the module docstring for the sharding); "vision"
    (tower + projector) is on rank 0 only, so "per_rank" is rank 0's. MXFP4 experts stay packed
    in a bf16 engine (`--moe-weights auto`) and are decoded to the model dtype otherwise."""
    out = {}
    size = lay.torch_dtype.itemsize
    for group, (split, rep) in weight_census(cfg).items():
        if group == "routed_experts" and cfg.quantization == "mxfp4" and lay.dtype == "bfloat16":
            total = math.ceil((split + rep) * MXFP4_BITS_PER_WEIGHT / 8)
        else:
            total = (split + rep) * size
        if group != "routed_experts":
            per_rank = _ceil_div(split * size, lay.tp) + rep * size
        elif lay.ep:
            per_rank = total // lay.expert_ranks
        else:
            per_rank = _ceil_div(total, lay.tp)
        out[group] = {"per_rank": per_rank, "total": total}
    tower = vision_bytes(vision, lay.torch_dtype)
    out["vision"] = {"per_rank": tower, "total": tower}
    out["total"] = {k: sum(v[k] for v in out.values()) for k in ("per_rank", "total")}
    return out


def _slot_bytes(cfg: ModelConfig, shards: int, lay: Layout) -> int:
    sharded = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, num_heads=cfg.kda.num_heads // shards))
    return unit_bytes(sharded, 1, lay.torch_dtype, STATE_DTYPES[lay.state_dtype])[0]


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else round(x, 2)


def _fits(lengths, layout: CacheLayout | None, memory: dict | None, slot: int, page: int, lay: Layout, seqs: int):
    """Per length: bytes of one request and, with a memory budget, how many run at once (live
    slots permitting) and how many the MLA pages alone hold."""
    rows = []
    for n in lengths:
        pages = _ceil_div(_ceil_div(n, lay.dcp), lay.page_size)
        held = None if memory is None else (0 if layout is None else layout.num_pages // pages)
        rows.append(
            {
                "tokens": n,
                "mla_bytes": pages * page,
                "request_bytes": pages * page + slot,
                "requests": None if held is None else min(held, seqs),
                "pages_hold": held,
            }
        )
    return rows


def _model(cfg: ModelConfig, vision: VisionConfig | None) -> dict:
    return {
        "family": cfg.family,
        "layers": cfg.num_hidden_layers,
        "kda_layers": len(cfg.kda_layer_ids),
        "mla_layers": len(cfg.mla_layer_ids),
        "kda_heads": cfg.kda.num_heads,
        "kda_head_dim": cfg.kda.head_dim,
        "mla_latent_dim": cfg.mla.latent_dim,
        "experts": cfg.moe.num_experts,
        "top_k": cfg.moe.top_k,
        "shared_experts": cfg.moe.num_shared_experts,
        "routed_experts_quantization": cfg.quantization,
        "vision_layers": None if vision is None else vision.num_layers,
    }


def _layout(cfg: ModelConfig, lay: Layout, max_len: int) -> dict:
    return {
        "tensor_parallel_size": lay.tp,
        "data_parallel_size": lay.dp,
        "decode_context_parallel_size": lay.dcp,
        "expert_parallel": lay.ep,
        "wide_expert_parallel": lay.wide_ep,
        "ranks": lay.ranks,
        "experts_per_rank": cfg.moe.num_experts // lay.expert_ranks if lay.ep else None,
        "dtype": lay.dtype,
        "kv_cache_dtype": lay.dtype,
        "kv_state_dtype": lay.state_dtype,
        "conv_state_dtype": lay.dtype,
        "page_size": lay.page_size,
        "max_model_len": max_len,
    }


def _memory(memory_per_rank: int | None, reserve_fraction: float, weights: int, encoder: int) -> dict | None:
    if memory_per_rank is None:
        return None
    reserve = int(memory_per_rank * reserve_fraction)
    return {
        "per_rank": memory_per_rank,
        "reserve": reserve,
        "reserve_fraction": reserve_fraction,
        "weights": weights,
        "encoder_cache": encoder,
        "pool": memory_per_rank - reserve - weights - encoder,
    }


def plan(
    cfg: ModelConfig,
    lay: Layout,
    memory_per_rank: int | None = None,
    max_model_len: int | None = None,
    reserve_fraction: float = 0.1,
    vision: VisionConfig | None = None,
    engine: EngineSettings | None = None,
    engine_defaults: EngineSettings | None = None,
) -> dict:
    """The whole plan as a JSON-ready dict (bytes are per rank, rank 0's, unless the key says
    total); `engine` holds the engine flags that size memory (default: the engine's defaults)."""
    check(cfg, lay)
    eng = engine or EngineSettings()
    if not 0 <= reserve_fraction < 1:
        raise PlanError(f"--reserve-fraction must lie in [0, 1), got {reserve_fraction}")
    if eng.max_num_seqs < 1 or eng.encoder_cache_memory < 0 or not 0 <= eng.checkpoint_fraction < 1:
        raise PlanError("--max-num-seqs must be >= 1, --encoder-cache-memory >= 0, --checkpoint-fraction in [0, 1)")
    max_len = max_model_len or cfg.max_position_embeddings
    if max_len < 1:
        raise PlanError(f"--max-model-len must be >= 1, got {max_len}")
    weights = weight_bytes(cfg, lay, vision)
    kv, state = lay.torch_dtype, STATE_DTYPES[lay.state_dtype]
    token, page = (unit_bytes(cfg, n, kv, state)[1] for n in (1, lay.page_size))
    slot = _slot_bytes(cfg, lay.tp, lay)
    encoder = eng.encoder_cache_memory if vision is not None else 0
    memory = _memory(memory_per_rank, reserve_fraction, weights["total"]["per_rank"], encoder)
    budget = None if memory is None else max(memory["pool"], 0)
    layout = engine_layout(cfg, eng, budget, max_len, lay.page_size, (kv, state), lay.tp, lay.dcp)
    cache = cache_section(layout, budget, eng)
    lengths = sorted({n for n in SHORT_LENGTHS if n < max_len} | {max_len})
    out = {
        "model": _model(cfg, vision),
        "layout": _layout(cfg, lay, max_len),
        "weights": weights,
        "mla_bytes_per_token": _number(token / lay.dcp),
        "kda_state_per_request": {"bytes": slot, "heads_per_rank": cfg.kda.num_heads // lay.tp},
        "encoder_cache": {"bytes": encoder},
        "memory": memory,
        "cache": cache,
        "total_per_rank": None if cache is None else weights["total"]["per_rank"] + encoder + cache["bytes"],
        "fits": _fits(lengths, layout if memory else None, memory, slot, page, lay, eng.max_num_seqs),
        "all_to_all": None,
    }
    if lay.wide_ep:
        size = lay.torch_dtype.itemsize
        steps = (eng.max_num_seqs, eng.max_num_batched_tokens)
        out["all_to_all"] = all_to_all(cfg, lay.expert_ranks, size, *steps, tp=lay.tp)
    out["engine_flags"] = engine_flags(out, eng, engine_defaults or EngineSettings())
    return out
