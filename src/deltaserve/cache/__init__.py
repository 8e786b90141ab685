"""The hybrid cache: paged MLA latents, KDA state slots, their sizing and the per-step view."""

from .budget import CacheLayout, build_pools, plan_layout, resolve_budget, size_layout, workload_layout
from .forward_batch import ForwardBatch
from .kda_pool import KdaStatePool, OutOfSlots
from .manager import CacheManager
from .mla_pool import MlaPagePool, OutOfPages

__all__ = [
    "CacheLayout",
    "CacheManager",
    "ForwardBatch",
    "KdaStatePool",
    "MlaPagePool",
    "OutOfPages",
    "OutOfSlots",
    "build_pools",
    "plan_layout",
    "resolve_budget",
    "size_layout",
    "workload_layout",
]
