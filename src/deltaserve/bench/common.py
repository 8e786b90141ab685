"""Shared pieces of the speed benchmarks: flags, the default model, prompts, timing and output.

Every speed benchmark takes `--model DIR` (default: the embedded random-weight tiny K3 that
`deltaserve serve` uses, generated once under the user cache directory), the engine flags of
`engine.config.add_engine_args` (so `--dtype`, `--threads` and any engine flag reach `LLM`; the
prefix cache is off unless `--enable-prefix-caching` is given, so repeated prompts measure the
engine, not hits) and `--json`. Output is a table, or with `--json` exactly one JSON object on
the last stdout line; every JSON object carries `meta` (date, machine, torch, threads, dtype, model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Callable


def int_list(v: str) -> list[int]:
    """`--lengths 4096,8192`: a comma list of positive ints."""
    try:
        out = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints, got {v!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {v!r}")
    return out


def add_common(p: argparse.ArgumentParser, dtype: str | None = None) -> None:
    from ..engine.config import add_engine_args

    p.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: the embedded random-weight tiny K3)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    add_engine_args(p)
    p.set_defaults(enable_prefix_caching=False)  # repeated prompts must not hit: --enable-prefix-caching
    if dtype is not None:
        p.set_defaults(dtype=dtype)


def model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from ..serve import default_model_dir

    return default_model_dir()


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's intra-op threads from `--threads` (if given); return the count in force."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()


def make_llm(args: argparse.Namespace, **overrides):
    """`LLM` of the engine flags with `overrides` (EngineConfig fields) applied, quiet."""
    from ..engine.config import EngineConfig
    from ..engine.llm import LLM

    return LLM.from_config(EngineConfig.from_args(args, model=str(model_dir(args)), progress=False, **overrides))


def with_tp_baseline(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict], keys: list[str]) -> dict:
    """`run(args)`; under `--tensor-parallel-size N > 1` also rank 0's wall time inside collectives
    per engine step (the step broadcast included; waiting for a slower rank counts too) and
    `<key>_vs_tp1`: each of `keys` divided by the same run on one process with as many threads as
    the ranks had together, measured right after in this run (ratios, never absolute thresholds)."""
    if args.tensor_parallel_size == 1:
        return run(args)
    from ..parallel import COMM

    COMM.reset()
    result = run(args)
    seconds, calls = COMM.seconds, COMM.calls
    one = argparse.Namespace(**vars(args))
    one.tensor_parallel_size, one.enable_expert_parallel, one.decode_context_parallel_size = 1, False, 1
    if args.threads is not None:  # the same cores: N ranks of T threads against one process of N x T
        one.threads = args.threads * args.tensor_parallel_size
    base = run(one)
    result["parallel"] = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "expert_parallel": args.enable_expert_parallel,
        "decode_context_parallel_size": args.decode_context_parallel_size,
        "comm_s": seconds,
        "comm_calls": calls,
        "comm_ms_per_step": 1e3 * seconds / max(1, result["steps"]),
        "tp1_threads": one.threads,
        **{f"{k}_vs_tp1": result[k] / base[k] for k in keys},
    }
    return result


def avoid_ids(llm) -> set[int]:
    """Stop and special token ids: random prompts never contain them."""
    tok = llm.tokenizer
    return set(llm.engine.eos_ids) | set(tok.special_ids if tok is not None else ())


def random_prompts(n: int, length: int, vocab: int, avoid: set[int], seed: int) -> list[list[int]]:
    """`n` prompts of `length` ids drawn uniformly from [0, vocab) minus `avoid`."""
    import torch

    pool = torch.tensor([t for t in range(vocab) if t not in avoid], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    return [pool[torch.randint(0, pool.numel(), (length,), generator=g)].tolist() for _ in range(n)]


def greedy(max_tokens: int):
    from ..engine.request.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Shortest wall time of `reps` calls (at least one)."""
    return min(timed(fn)[0] for _ in range(max(1, reps)))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def meta(args: argparse.Namespace, model: Path | None = None) -> dict:
    import torch

    from ..model.huge_pages import huge_page_setting

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "model": str(model) if model is not None else None,
        "huge_pages": huge_page_setting(),
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return "-" if v is None else str(v)


def emit(args: argparse.Namespace, result: dict, rows: list[dict] | None = None, cols: list[str] | None = None) -> int:
    """With `--json`: one line `json.dumps(result)`. Otherwise a `|` table of `rows` over
    `cols` (if given) followed by the scalar entries of `result` and of its dicts one level down."""
    if args.json:
        print(json.dumps(result))
        return 0
    if rows and cols:
        print(" | ".join(cols))
        for r in rows:
            print(" | ".join(_fmt(r.get(c)) for c in cols))
    for k, v in result.items():
        if isinstance(v, (int, float, str)) or v is None:
            print(f"{k:36s} {_fmt(v)}")
        elif isinstance(v, dict) and k != "meta":
            for sub, x in v.items():
                if isinstance(x, (int, float, str)) or x is None:
                    print(f"{k + '.' + sub:36s} {_fmt(x)}")
    m = result.get("meta", {})
    print(f"# {m.get('date')} {m.get('cpu')} threads={m.get('threads')} dtype={m.get('dtype')} model={m.get('model')}")
    return 0
