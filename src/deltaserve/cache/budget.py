"""Sizing the two pools from one memory budget (spec/serving.md §1.1: per-layer-type costs).

A running sequence owns exactly one live KDA slot, so the live pool gets `max_num_seqs` slots;
with prefix caching, `checkpoint_fraction` of the budget becomes checkpoint slots (at least one,
and fewer where that share would leave less than `max_model_len` tokens of MLA pages); every
remaining byte goes to MLA pages. The budget must hold at least `max_model_len` tokens of MLA
pages, otherwise a lone long request could never run (it would re-prefill forever).

`size_layout` picks the budget: an explicit `kv_cache_memory` as given (on CPU an error where it
exceeds the RAM available after the weights, in this process, instead of pools the kernel would
kill the process for); by default the smaller of `DEFAULT_RAM_FRACTION` of RAM (at most
`DEFAULT_AVAILABLE_FRACTION` of the RAM available; on CUDA: the device memory free after the
weights, keeping `1 - DEFAULT_GPU_FRACTION` of the device spare) and `workload_layout`, what
`max_num_seqs` sequences of `max_model_len` tokens can use (a tiny model never reserves gigabytes
it cannot fill).

Under tensor parallelism (`tp`) every figure is per rank: a slot holds only the rank's KDA heads
(H/W heads, 3P/W conv channels) and, under decode context parallelism, a page only the rank's
S/D positions. Every rank has the same slot and page counts (rank 0 sizes them and the others
build pools of that size), so a slot or page id means the same thing on every rank.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from fractions import Fraction

import torch

from ..model.config import ModelConfig
from ..model.huge_pages import available_bytes
from ..parallel import SINGLE, ParallelContext
from .kda_pool import KdaStatePool
from .mla_pool import MlaPagePool
from .slot_journal import CHECKPOINT, LIVE

log = logging.getLogger(__name__)

DEFAULT_RAM_FRACTION = 0.1
DEFAULT_AVAILABLE_FRACTION = 0.9  # of the RAM available after the weights the CPU default may take
DEFAULT_GPU_FRACTION = 0.9  # of a CUDA device's memory the weights and the default KV cache may use
PREFIX_HEADROOM = 2  # default sizing with prefix caching: MLA pages for the live sequences, twice


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory(device: torch.device | str = "cpu") -> tuple[int, int]:
    """(free, total) bytes of the memory the pools live in, free measured now (after the weights,
    which are loaded first): the CUDA device's, else physical RAM and MemAvailable (total where
    /proc/meminfo cannot be read). On CPU the weights are anonymous memory (`model.huge_pages`),
    so MemAvailable leaves them out; memory-mapped ones (`DELTASERVE_HUGE_PAGES=0`) count as
    reclaimable page cache there."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    total = total_ram_bytes()
    free = available_bytes()
    return (total if free is None else free), total


def resolve_budget(kv_cache_memory: int | float, device: torch.device | str = "cpu") -> int:
    """An int is bytes; a float in (0, 1] is a fraction of the device's memory (RAM on CPU)."""
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)):
        raise ValueError(f"kv_cache_memory must be bytes (int) or a RAM fraction (float), got {kv_cache_memory!r}")
    if isinstance(kv_cache_memory, float):
        if not 0.0 < kv_cache_memory <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must lie in (0, 1], got {kv_cache_memory}")
        return int(kv_cache_memory * device_memory(device)[1])
    if kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {kv_cache_memory}")
    return kv_cache_memory


@dataclass(frozen=True)
class CacheLayout:
    page_size: int
    num_pages: int
    num_slots: int
    page_bytes: int
    slot_bytes: int
    kv_dtype: torch.dtype
    state_dtype: torch.dtype
    num_checkpoint_slots: int = 0

    @property
    def token_capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes + (self.num_slots + self.num_checkpoint_slots) * self.slot_bytes


def kda_shapes(cfg: ModelConfig, tp: ParallelContext = SINGLE) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv tail [W-1, 3P/world], state [H/world, K, V]) of one layer's slot on a rank of `tp`."""
    k = cfg.kda
    heads = tp.split(k.num_heads, "KDA heads")
    return (k.conv_kernel - 1, 3 * heads * k.head_dim), (heads, k.head_dim, k.head_dim)


def unit_bytes(
    cfg: ModelConfig, page_size: int, kv_dtype: torch.dtype, state_dtype: torch.dtype, tp: ParallelContext = SINGLE
) -> tuple[int, int]:
    """(bytes of one KDA state slot, bytes of one MLA page) across all layers, on one rank of `tp`."""
    tail, state = kda_shapes(cfg, tp)
    return (
        KdaStatePool.bytes_per_slot(len(cfg.kda_layer_ids), tail, state, kv_dtype, state_dtype),
        MlaPagePool.bytes_per_page(len(cfg.mla_layer_ids), page_size, cfg.mla.latent_dim, kv_dtype, tp.dcp_world),
    )


def _check_sizes(page_size: int, max_num_seqs: int, checkpoint_fraction: float) -> None:
    if page_size < 1 or max_num_seqs < 1:
        raise ValueError("page_size and max_num_seqs must be positive")
    if not 0.0 <= checkpoint_fraction < 1.0:
        raise ValueError(f"checkpoint_fraction must lie in [0, 1), got {checkpoint_fraction}")


def plan_layout(
    cfg: ModelConfig,
    budget_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    kv_dtype: torch.dtype,
    state_dtype: torch.dtype = torch.float32,
    checkpoint_fraction: float = 0.0,
    tp: ParallelContext = SINGLE,
) -> CacheLayout:
    """Split `budget_bytes` as the module docstring says; `total_bytes <= budget_bytes`."""
    _check_sizes(page_size, max_num_seqs, checkpoint_fraction)
    slot_bytes, page_bytes = unit_bytes(cfg, page_size, kv_dtype, state_dtype, tp)
    need = -(-max_model_len // page_size)
    n_ckpt = max(1, int(checkpoint_fraction * budget_bytes) // slot_bytes) if checkpoint_fraction else 0
    if n_ckpt > 1:  # checkpoints never take the pages a lone max_model_len request needs
        spare = budget_bytes - max_num_seqs * slot_bytes - need * page_bytes
        n_ckpt = max(1, min(n_ckpt, spare // slot_bytes))
    left = budget_bytes - (max_num_seqs + n_ckpt) * slot_bytes
    num_pages = left // page_bytes if page_bytes and left > 0 else 0
    if num_pages < need:
        raise ValueError(
            f"kv_cache_memory={budget_bytes} B cannot hold {max_num_seqs} + {n_ckpt} KDA slots "
            f"({slot_bytes} B each) plus MLA pages for max_model_len={max_model_len} tokens "
            f"({need} pages of {page_bytes} B); raise kv_cache_memory or lower max_num_seqs/max_model_len"
            + (" (or turn prefix caching off: --no-enable-prefix-caching)" if n_ckpt else "")
        )
    return CacheLayout(page_size, int(num_pages), max_num_seqs, page_bytes, slot_bytes, kv_dtype, state_dtype, n_ckpt)


def workload_layout(
    cfg: ModelConfig,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    kv_dtype: torch.dtype,
    state_dtype: torch.dtype = torch.float32,
    checkpoint_fraction: float = 0.0,
    tp: ParallelContext = SINGLE,
) -> CacheLayout:
    """The pools `max_num_seqs` sequences of `max_model_len` tokens can use at once: their MLA
    pages and live slots. With prefix caching (`checkpoint_fraction > 0`) the MLA pages are
    doubled (`PREFIX_HEADROOM`: cached prefixes may hold as much again) and checkpoint slots are
    added until they are `checkpoint_fraction` of the total, as `plan_layout` would split it
    (rounded up, at least one)."""
    _check_sizes(page_size, max_num_seqs, checkpoint_fraction)
    if max_model_len < 1:
        raise ValueError("max_model_len must be positive")
    slot_bytes, page_bytes = unit_bytes(cfg, page_size, kv_dtype, state_dtype, tp)
    headroom = PREFIX_HEADROOM if checkpoint_fraction else 1
    num_pages = max_num_seqs * -(-max_model_len // page_size) * headroom
    live = num_pages * page_bytes + max_num_seqs * slot_bytes
    f = Fraction(checkpoint_fraction)
    n_ckpt = max(1, math.ceil(f * live / ((1 - f) * slot_bytes))) if f else 0
    return CacheLayout(page_size, num_pages, max_num_seqs, page_bytes, slot_bytes, kv_dtype, state_dtype, n_ckpt)


def size_layout(
    cfg: ModelConfig,
    kv_cache_memory: int | float | None,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    kv_dtype: torch.dtype,
    state_dtype: torch.dtype = torch.float32,
    checkpoint_fraction: float = 0.0,
    tp: ParallelContext = SINGLE,
    device: torch.device | str = "cpu",
) -> CacheLayout:
    """The layout for `kv_cache_memory` (bytes, a fraction of the device's memory, or None for
    the default: the smaller of `workload_layout` and, on CPU, `DEFAULT_RAM_FRACTION` of RAM capped
    at `DEFAULT_AVAILABLE_FRACTION` of the RAM available, on CUDA what is free after the weights
    less `1 - DEFAULT_GPU_FRACTION` of the device, as vLLM's `gpu_memory_utilization`); on CPU an
    explicit budget above the RAM available is a ValueError. Logs the sizes and why."""
    args = (max_num_seqs, max_model_len, page_size, kv_dtype, state_dtype, checkpoint_fraction, tp)
    if kv_cache_memory is not None:
        layout = plan_layout(cfg, resolve_budget(kv_cache_memory, device), *args)
        why = f"kv_cache_memory={kv_cache_memory!r} as given"
        if torch.device(device).type == "cpu" and layout.total_bytes > (free := device_memory(device)[0]):
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory!r} asks for {layout.total_bytes / 2**20:.0f} MiB of KV cache but "
                f"only {free / 2**20:.0f} MiB of RAM are available after the weights; lower it"
            )
    else:
        fit = workload_layout(cfg, *args)
        if torch.device(device).type == "cuda":
            free, total = device_memory(device)
            ram = free - int((1 - DEFAULT_GPU_FRACTION) * total)
            pct = f"the device memory free after the weights less {1 - DEFAULT_GPU_FRACTION:.0%} of it"
            if ram < fit.page_bytes * -(-max_model_len // page_size):
                raise ValueError(
                    f"only {max(ram, 0) / 2**20:.0f} MiB of {device} are left for the KV cache after the "
                    f"weights: not enough for max_model_len={max_model_len}; lower it or use more devices"
                )
        else:
            ram, pct = resolve_budget(DEFAULT_RAM_FRACTION), f"{DEFAULT_RAM_FRACTION:.0%} of RAM"
            free = int(DEFAULT_AVAILABLE_FRACTION * device_memory(device)[0])
            if free < ram:
                ram, pct = free, f"{DEFAULT_AVAILABLE_FRACTION:.0%} of the RAM available after the weights"
        use = f"max_num_seqs={max_num_seqs} x max_model_len={max_model_len} tokens can use" + (
            f" (MLA pages x{PREFIX_HEADROOM} for cached prefixes)" if checkpoint_fraction else ""
        )
        if fit.total_bytes <= ram:
            layout, why = fit, f"default: what {use}, less than {pct} ({ram / 2**20:.1f} MiB)"
        else:
            layout = plan_layout(cfg, ram, *args)
            why = f"default: {pct}, less than the {fit.total_bytes / 2**20:.1f} MiB {use}"
    slots = max_num_seqs + layout.num_checkpoint_slots
    log.info(
        "KV cache %.1f MiB%s (%s): %d MLA pages x %d tokens = %d tokens (%.1f MiB), %d live KDA slots "
        "+ %d checkpoint slots (%.1f MiB)",
        layout.total_bytes / 2**20,
        f" per rank of {tp.world}" if tp.world > 1 else "",
        why,
        layout.num_pages,
        page_size,
        layout.token_capacity,
        layout.num_pages * layout.page_bytes / 2**20,
        max_num_seqs,
        layout.num_checkpoint_slots,
        slots * layout.slot_bytes / 2**20,
    )
    return layout


def build_pools(
    cfg: ModelConfig, layout: CacheLayout, device: torch.device | str = "cpu", tp: ParallelContext = SINGLE
) -> tuple[MlaPagePool, KdaStatePool, KdaStatePool | None]:
    """The live MLA and KDA pools and the checkpoint pool (None without checkpoint slots) of one
    rank of `tp`, `layout`'s counts with the rank's shapes."""
    tail, state = kda_shapes(cfg, tp)
    mla = MlaPagePool(
        cfg.mla_layer_ids, layout.num_pages, layout.page_size, cfg.mla.latent_dim, layout.kv_dtype, device, tp.dcp_world
    )
    dtypes = (layout.kv_dtype, layout.state_dtype, device)
    kda = KdaStatePool(cfg.kda_layer_ids, layout.num_slots, tail, state, *dtypes, name=LIVE)
    ckpt = (
        KdaStatePool(cfg.kda_layer_ids, layout.num_checkpoint_slots, tail, state, *dtypes, name=CHECKPOINT)
        if layout.num_checkpoint_slots
        else None
    )
    return mla, kda, ckpt
