"""`EngineConfig`: every engine setting in one frozen dataclass, and the CLI flags generated from
it (vLLM's names). No heavy imports: the command line builds its parsers from this module.

Invariants:
- every field but `NO_FLAG`'s (each command owns those: `deltaserve serve` runs its own
  replicas for `--data-parallel-size`) has exactly one flag,
  `--<field-name-with-dashes>` unless its metadata names another (`--threads`, `--engine-seed`);
- a flag's default is the field's default unless the metadata gives a `cli_default` (the CLI's
  own choice, e.g. `--max-model-len 8192`), and `from_args` maps a parsed value back through
  the metadata's `from_cli` (e.g. `--structured-thinking-budget -1` -> None, unlimited).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# reasoning budget of a structured request that starts after reasoning and sets none (engine/request/reasoning.py)
DEFAULT_STRUCTURED_THINKING_BUDGET = 1024
DEFAULT_ENCODER_CACHE_BYTES = 512 << 20  # image projector rows kept (engine/exec/encoder_cache.py)
# patches of all a request's images: 4 images at K3's in_patch_limit (65536) with their padding
DEFAULT_MAX_IMAGE_PATCHES = 270_000
MOE_WEIGHTS = ("auto", "packed", "dequantized")
NO_FLAG = ("model", "progress", "data_parallel_size", "data_parallel_rank", "data_parallel_init_method")


def memory_budget(v: str) -> int | float:
    """`--kv-cache-memory`: bytes as an integer, or a fraction of RAM written with a dot."""
    return float(v) if "." in v else int(v)


def size_arg(v: str) -> int:
    """`--kv-offload-memory`, `--kv-disk-size`: '8GiB', '100GB' or bytes."""
    from ..cache.plan import parse_bytes

    return parse_bytes(v)


def json_object(v: str) -> dict:
    """`--speculative-config`: a JSON object (checked in full by engine/spec/config.py)."""
    try:
        value = json.loads(v)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _budget_from_cli(v: int) -> int | None:
    return None if v < 0 else v


def _opt(default: Any, help: str, **cli: Any) -> Any:
    """A field whose metadata describes its flag: `type`, `choices`, `action`, `flag`,
    `cli_default`, `from_cli` (parsed value -> field value)."""
    return field(default=default, metadata=dict(help=help, **cli))


@dataclass(frozen=True)
class EngineConfig:
    """What `build_engine` needs to start an engine; defaults are `LLM`'s.

    `kv_cache_memory` is bytes (int) or a fraction of physical RAM (float; on CUDA of the device's
    memory), honoured as given; None: what `max_num_seqs` sequences of `max_model_len` tokens can
    use, at most 10 % of RAM (on CUDA: the device memory free after the weights, less 10 %).
    `max_model_len` None (or 0) means the checkpoint's `max_position_embeddings`.
    `structured_thinking_budget` None is unlimited. `data_parallel_size` N > 1: the offline `LLM`
    runs N replicas of this engine (engine/dp/client.py); `build_engine` builds one. Values are
    checked here where that needs no model (the same errors the builder would raise later)."""

    model: str | Path
    dtype: Any = _opt("bfloat16", "activation and weight dtype", choices=["bfloat16", "float32"])
    max_num_seqs: int = _opt(16, "most sequences in one step", type=int)
    max_num_batched_tokens: int = _opt(2048, "most tokens in one step (chunked prefill)", type=int)
    page_size: int = _opt(16, "MLA page size in tokens", type=int)
    kv_cache_memory: int | float | None = _opt(
        None,
        "bytes (integer) or a fraction of RAM, of device memory on CUDA (with a dot, e.g. 0.1); default: "
        "what --max-num-seqs x --max-model-len tokens can use, at most 10%% of RAM (on CUDA: what the "
        "weights leave, less 10%% of the device)",
        type=memory_budget,
    )
    max_model_len: int | None = _opt(None, "longest sequence (prompt + output) in tokens", type=int, cli_default=8192)
    kv_state_dtype: Any = _opt("float32", "dtype of the KDA recurrent state", choices=["float32", "bfloat16"])
    skip_tokenizer_init: bool = _opt(
        False, "load no tokenizer: prompts are token ids, outputs carry no text", action="store_true"
    )
    seed: int = _opt(0, "engine seed of requests that set none", type=int, flag="--engine-seed")
    device: str = _opt("cpu", "torch device of the model and the caches (auto: cuda when present)")
    num_threads: int | None = _opt(None, "torch intra-op threads", type=int, flag="--threads")
    progress: bool = True
    enable_prefix_caching: bool = _opt(
        True,
        "hybrid prefix cache: MLA pages + KDA checkpoints, both halves or nothing (on by default, as vLLM's)",
        action=argparse.BooleanOptionalAction,
    )
    prefix_match_unit: int = _opt(64, "hit granularity in tokens (a multiple of --page-size)", type=int)
    kda_checkpoint_policy: str = _opt("default", "'default' or a comma list of prompt-end, junction, turn-end")
    kda_checkpoint_interval: int | None = _opt(
        None, "also checkpoint every N prompt tokens (a multiple of the match unit)", type=int
    )
    checkpoint_fraction: float = _opt(
        0.25, "share of the cache budget kept for KDA checkpoints (with prefix caching)", type=float
    )
    kv_offload_memory: int | str | None = _opt(
        None, "host memory (e.g. 8GiB) for a tier of prefix-cache objects under the device pools", type=size_arg
    )
    kv_disk_path: str | None = _opt(
        None, "directory of a persistent disk tier of prefix-cache objects (data-parallel replica i: DIR/replica-i)"
    )
    kv_disk_size: int | str | None = _opt(
        None,
        "disk the --kv-disk-path tier may use, each replica (e.g. 100GiB; default: half the free space)",
        type=size_arg,
    )
    kv_store: str | None = _opt(
        None, "mooncake://HOST:PORT: a Mooncake Store (its master) shared by instances as a third prefix-cache tier"
    )
    kv_store_size: int | str | None = _opt(
        None, "host memory this engine lends to the --kv-store as its segment (e.g. 4GiB; default: none)", type=size_arg
    )
    moe_weights: str = _opt(
        "auto",
        "keep MXFP4 routed experts packed (~4.25 bits/weight) or decode them at "
        "load (auto: packed for bfloat16, decoded otherwise)",
        choices=list(MOE_WEIGHTS),
    )
    structured_thinking_budget: int | None = _opt(
        DEFAULT_STRUCTURED_THINKING_BUDGET,
        "reasoning tokens a structured request (response_format json, forced tool_choice) with thinking "
        "on may use before the engine closes the think element, unless it sets thinking_token_budget; "
        "-1: unlimited",
        type=int,
        from_cli=_budget_from_cli,
    )

    encoder_cache_memory: int = _opt(
        DEFAULT_ENCODER_CACHE_BYTES,
        "bytes of image projector rows kept for re-sent images (K3 with a vision tower)",
        type=int,
    )
    max_encoder_patches_per_step: int | None = _opt(
        None,
        "image patches of vision-tower work per engine step (a large image is encoded over several "
        "steps while the other requests keep stepping); default: sized from memory",
        type=int,
    )
    max_image_patches_per_request: int = _opt(
        DEFAULT_MAX_IMAGE_PATCHES,
        "most vision patches of all the images of one request, computed from their sizes before "
        "any pixel is decoded (over it: 400)",
        type=int,
    )
    tensor_parallel_size: int = _opt(1, "processes the model is split across (heads, widths, vocab)", type=int)
    enable_expert_parallel: bool = _opt(
        False,
        "split routed experts by expert across the tensor-parallel ranks; with --data-parallel-size N: "
        "across every rank of the N replicas (wide EP: attention data-parallel, tokens exchanged by all-to-all)",
        action="store_true",
    )
    decode_context_parallel_size: int = _opt(
        1, "split the MLA latent cache by position across this many of the tensor-parallel ranks", type=int
    )
    distributed_init_method: str | None = _opt(
        None, "tcp://HOST:PORT rank 0 listens on (default: a free loopback port; required with --nnodes > 1)"
    )
    nnodes: int = _opt(1, "machines the tensor-parallel ranks span (ranks split evenly)", type=int)
    node_rank: int = _opt(0, "this machine's index; node 0 runs the scheduler and the API", type=int)
    distributed_timeout: float = _opt(
        60.0,
        "seconds a model collective may wait for a rank (or a data-parallel replica with requests stay "
        "silent) before the engine is declared failed",
        type=float,
    )
    speculative_config: dict | str | None = _opt(
        None,
        'speculative decoding, vLLM\'s JSON: {"method": "ngram"|"suffix"|"draft_model", "num_speculative_tokens": k, '
        '"model": PATH (draft_model), ...} '
        "(engine/spec/config.py lists the keys); greedy outputs are unchanged, sampled ones keep their distribution",
        type=json_object,
    )
    data_parallel_size: int = 1  # engine replicas the offline LLM spreads requests over (engine/dp/client.py)
    # wide EP (`wide_expert_parallel`): this replica's rank in the expert-parallel group and its rendezvous
    data_parallel_rank: int = 0
    data_parallel_init_method: str | None = None

    @property
    def wide_expert_parallel(self) -> bool:
        """Experts split over the data-parallel replicas (each one rank of the EP group)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    def check_parallel(self) -> None:
        """The parallel fields fit together (checked when the engine starts, since single flags
        may be given in any order)."""
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        if tp % dcp:
            raise ValueError(f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp}")
        if self.wide_expert_parallel and dcp > 1:
            raise ValueError(
                "wide expert parallelism (data_parallel_size > 1 with enable_expert_parallel) does not "
                "run decode context parallelism yet: decode_context_parallel_size must be 1"
            )
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError("data_parallel_size > 1 runs on one machine: it cannot be combined with nnodes > 1")
        tiers = (self.kv_offload_memory, self.kv_disk_path, self.kv_store)
        if tp > 1 and any(t is not None for t in tiers):
            raise ValueError(
                "cache tiers (--kv-offload-memory, --kv-disk-path, --kv-store) need tensor_parallel_size 1 "
                "(no decode context parallelism either)"
            )
        if tp % self.nnodes or self.node_rank >= self.nnodes:
            raise ValueError(
                f"{self.nnodes} nodes must split tensor_parallel_size={tp} evenly "
                f"and node_rank={self.node_rank} lie in [0, {self.nnodes})"
            )

    def __post_init__(self):
        if min(self.tensor_parallel_size, self.decode_context_parallel_size, self.nnodes) < 1 or self.node_rank < 0:
            raise ValueError(
                "tensor_parallel_size, decode_context_parallel_size, nnodes must be positive, node_rank >= 0"
            )
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {dp!r}")
        if self.max_num_seqs < 1 or self.page_size < 1:
            raise ValueError("page_size and max_num_seqs must be positive")
        if self.max_model_len is not None and self.max_model_len < 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.prefix_match_unit < 1:
            raise ValueError("prefix_match_unit must be positive")
        if self.enable_prefix_caching and not 0.0 <= self.checkpoint_fraction < 1.0:
            raise ValueError(f"checkpoint_fraction must lie in [0, 1), got {self.checkpoint_fraction}")
        budget = self.max_encoder_patches_per_step
        if (budget is not None and budget < 1) or self.max_image_patches_per_request < 1:
            raise ValueError("max_encoder_patches_per_step and max_image_patches_per_request must be positive")
        if self.moe_weights not in MOE_WEIGHTS:
            raise ValueError(f"moe_weights must be one of {MOE_WEIGHTS}, got {self.moe_weights!r}")
        if self.kv_store is not None:
            from ..cache.tiers.mooncake import parse_url

            parse_url(self.kv_store)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        """The config of flags added by `add_engine_args`; `model` comes from `overrides` or
        `args.model`, `progress` from `overrides` (default True); `overrides` win."""
        values = {}
        for f in cli_fields():
            v = getattr(args, flag_dest(f))
            values[f.name] = f.metadata["from_cli"](v) if "from_cli" in f.metadata else v
        if "model" not in overrides:
            values["model"] = args.model
        return cls(**(values | overrides))


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in NO_FLAG]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def flag_dest(f: dataclasses.Field) -> str:
    return flag_name(f)[2:].replace("-", "_")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per `cli_fields()` entry, generated from the field's metadata."""
    for f in cli_fields():
        m = f.metadata
        kw = {k: m[k] for k in ("type", "choices", "action") if k in m}
        if m.get("action") != "store_true":
            kw["default"] = m.get("cli_default", f.default)
        p.add_argument(flag_name(f), help=m["help"], **kw)
