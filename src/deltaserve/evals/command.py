"""`deltaserve eval [MODEL_DIR | --url URL]`: accuracy per task on a held-out curriculum seed."""

from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import closing
from pathlib import Path

from ..chat.render import load_chat_template
from ..model.config import ModelConfig
from ..model.tokenizer import Tokenizer
from ..train.curriculum import eval_set
from ..train.tasks import RECALL_TOKENS_PER_UNIT, TASKS, tokens_per_unit
from .runner import MAX_TOKENS, EvalPath, OfflineRunner, ServerRunner, longest_request
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
    model = tokenizer = template = None
    if args.url:
        family, unit_tokens = None, RECALL_TOKENS_PER_UNIT
    else:
        model = Path(args.model or _default_model())
        family, tokenizer = ModelConfig.from_pretrained(model).family, Tokenizer.from_pretrained(model)
        template = load_chat_template(model)
        unit_tokens = tokens_per_unit(tokenizer.encode)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.thinking]
    if family == "kimi_linear":
        modes = [False]
    recall = (args.recall_min, args.recall_max)
    sets = {t: eval_set(t, args.num_samples, args.seed, recall, unit_tokens) for t in tasks}
    # offline with --preempt: an engine per task, its KV budget sized to that task's longest request
    groups = [[t] for t in tasks] if model is not None and args.preempt else [tasks]
    accuracy, hits, preemptions = {}, 0, 0
    path = EvalPath(
        prefix_cache=args.prefix_cache,
        chunk_size=args.chunk_size,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
    )
    for group in groups:
        if model is None:
            runner = ServerRunner(args.url, api_key=args.api_key, max_tokens=args.max_tokens)
        else:
            if args.preempt:  # a KV budget for 1.25x the group's longest request: several do not fit
                samples = [s for t in group for s in sets[t]]
                most = longest_request(tokenizer, template, family, samples, modes, args.max_tokens)
                path = dataclasses.replace(path, preempt=True, preempt_len=most)
            runner = OfflineRunner(model, path)
        with closing(runner):
            for thinking in modes:
                for task in group:
                    accuracy[task, thinking] = score(sets[task], runner.run(sets[task], thinking))[task].accuracy
            if model is not None:
                st = runner.stats()
                hits += st.get("prefix_cache", {}).get("hits", 0)
                preemptions += st["preemptions"]
    report: dict = {"tasks": {}, "seed": args.seed, "num_samples": args.num_samples}
    for thinking in modes:
        for task in tasks:
            report["tasks"][f"{task}/{'think' if thinking else 'no-think'}"] = round(accuracy[task, thinking], 4)
    if model is not None:
        report["prefix_cache_hits"], report["preemptions"] = hits, preemptions
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
