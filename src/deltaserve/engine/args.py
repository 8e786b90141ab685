"""The engine's command-line flags (vLLM's names), shared by `deltaserve generate` and
`deltaserve serve`, and their mapping onto `LLM(...)` keyword arguments. No heavy imports."""
from __future__ import annotations

import argparse

# reasoning budget of a structured request that starts after reasoning and sets none (engine/reasoning.py)
DEFAULT_STRUCTURED_THINKING_BUDGET = 1024


def memory_budget(v: str) -> int | float:
    """`--kv-cache-memory`: bytes as an integer, or a fraction of RAM written with a dot."""
    return float(v) if "." in v else int(v)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-memory", type=memory_budget, default=None,
                   help="bytes (integer) or a fraction of RAM (with a dot, e.g. 0.1); default: what "
                        "--max-num-seqs x --max-model-len tokens can use, at most 10%% of RAM")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--moe-weights", default="auto", choices=["auto", "packed", "dequantized"],
                   help="keep MXFP4 routed experts packed (~4.25 bits/weight) or decode them at load"
                        " (auto: packed for bfloat16, decoded otherwise)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="hybrid prefix cache: MLA pages + KDA checkpoints, both halves or nothing")
    p.add_argument("--prefix-match-unit", type=int, default=64,
                   help="hit granularity in tokens (a multiple of --page-size)")
    p.add_argument("--kda-checkpoint-policy", default="default",
                   help="'default' or a comma list of prompt-end, junction, turn-end")
    p.add_argument("--kda-checkpoint-interval", type=int, default=None,
                   help="also checkpoint every N prompt tokens (a multiple of the match unit)")
    p.add_argument("--structured-thinking-budget", type=int, default=DEFAULT_STRUCTURED_THINKING_BUDGET,
                   help="reasoning tokens a structured request (response_format json, forced "
                        "tool_choice) with thinking on may use before the engine closes the think "
                        "element, unless it sets thinking_token_budget; -1: unlimited")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM(model, **engine_kwargs(args))` for flags added by `add_engine_args`."""
    return dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size,
                kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                num_threads=args.threads, enable_prefix_caching=args.enable_prefix_caching,
                prefix_match_unit=args.prefix_match_unit, kda_checkpoint_policy=args.kda_checkpoint_policy,
                kda_checkpoint_interval=args.kda_checkpoint_interval, moe_weights=args.moe_weights,
                structured_thinking_budget=None if args.structured_thinking_budget < 0
                else args.structured_thinking_budget)
