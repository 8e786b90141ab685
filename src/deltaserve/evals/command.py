"""`deltaserve eval [MODEL_DIR | --url URL]`: accuracy per task on a held-out curriculum seed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..train.curriculum import eval_set
from ..train.tasks import RECALL_TOKENS_PER_UNIT, TASKS, tokens_per_unit
from .runner import MAX_TOKENS, EvalPath, OfflineRunner, ServerRunner
from .score import score


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy per task of a model on held-out curriculum tasks (offline or a server)")
    p.add_argument("model", nargs="?", type=Path, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--url", help="score a running server (e.g. a `deltaserve proxy` of a PD pair) instead")
    p.add_argument("--api-key")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma list of %(default)s")
    p.add_argument("-n", "--num-samples", type=int, default=50, help="samples per task")
    p.add_argument("--seed", type=int, default=0, help="held-out seed (never a training seed)")
    p.add_argument("--thinking", choices=["on", "off", "both"], default="both", help="K3 thinking mode(s)")
    p.add_argument("--recall-min", type=int, default=1024, help="shortest recall context (tokens)")
    p.add_argument("--recall-max", type=int, default=4096, help="longest recall context (tokens)")
    p.add_argument("--prefix-cache", action="store_true", help="run twice, score the prefix-hit pass")
    p.add_argument("--chunk-size", type=int, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--preempt", action="store_true", help="a KV budget small enough to force preemptions")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="longest answer (tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise SystemExit(f"deltaserve eval: unknown task(s) {unknown}; choose from {list(TASKS)}")
    if args.url:
        runner = ServerRunner(args.url, api_key=args.api_key, max_tokens=args.max_tokens)
        family, unit_tokens = None, RECALL_TOKENS_PER_UNIT
    else:
        path = EvalPath(
            prefix_cache=args.prefix_cache,
            chunk_size=args.chunk_size,
            preempt=args.preempt,
            tensor_parallel_size=args.tensor_parallel_size,
            dtype=args.dtype,
            max_tokens=args.max_tokens,
        )
        runner = OfflineRunner(args.model or _default_model(), path)
        family = runner.family
        unit_tokens = tokens_per_unit(runner.llm.tokenizer.encode)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.thinking]
    if family == "kimi_linear":
        modes = [False]
    report: dict = {"tasks": {}, "seed": args.seed, "num_samples": args.num_samples}
    try:
        for thinking in modes:
            for task in tasks:
                samples = eval_set(task, args.num_samples, args.seed, (args.recall_min, args.recall_max), unit_tokens)
                s = score(samples, runner.run(samples, thinking))[task]
                report["tasks"][f"{task}/{'think' if thinking else 'no-think'}"] = round(s.accuracy, 4)
        if not args.url:
            st = runner.stats()
            report["prefix_cache_hits"] = st.get("prefix_cache", {}).get("hits", 0)
            report["preemptions"] = st["preemptions"]
    finally:
        runner.close()
    if args.json:
        print(json.dumps(report))
    else:
        for name, acc in report["tasks"].items():
            print(f"{name:28s} {acc:6.3f}", flush=True)
        print({k: v for k, v in report.items() if k != "tasks"})
    return 0


def _default_model() -> Path:
    from ..serve import default_model_dir

    return default_model_dir()
