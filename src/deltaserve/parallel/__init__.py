"""Parallelism: the tensor-parallel context layers are built with (`context.ParallelContext`),
the vocab-parallel embedding, and the per-rank checkpoint slicing the loader uses.
Imports only torch and safetensors (model/ builds on it)."""

from .context import (
    COMM,
    SINGLE,
    ParallelContext,
    ProcessGroupTaken,
    check_process_group_free,
    init_expert_parallel,
    init_tensor_parallel,
    leave_tensor_parallel,
    shard,
)
from .embedding import VocabParallelEmbedding

__all__ = [
    "COMM",
    "SINGLE",
    "ParallelContext",
    "ProcessGroupTaken",
    "VocabParallelEmbedding",
    "check_process_group_free",
    "init_expert_parallel",
    "init_tensor_parallel",
    "leave_tensor_parallel",
    "shard",
]
