"""`deltaserve bench throughput`: offline throughput of `--num-prompts` requests of
`--input-len` random tokens and `--output-len` generated tokens (greedy, `ignore_eos`) at each
`--concurrency` (the scheduler's `max_num_seqs`), on one loaded engine.

The engine is built once with `max_num_seqs` = the largest concurrency (cache sized for it) and
the scheduler's cap is lowered per run, so every run shares weights and cache layout. Each run
gets fresh prompts (no prefix-cache hits across runs). Tokens/s are wall-clock over one
`generate` call holding all requests; ratios are to the smallest concurrency (1 by default).
With `--tensor-parallel-size N`: `parallel.comm_ms_per_step` and `parallel.<key>_vs_tp1` (output tok/s
at the top concurrency over the same run on one process).

Beside each run, its roofline (on one process; not under tensor parallelism, nor with
`--no-roofline`): this machine's bandwidth and GEMM rate are measured after the runs
(`bench roofline`), and each run's least possible time is its prompts' prefill FLOPs at the GEMM
rate plus P x (output_len - 1) / c decode steps of c = min(concurrency, P) sequences at context
input_len + output_len / 2, each `accounting.roofline_seconds` of `accounting.decode_step`.
`roofline_output_tok_s` is the output tokens over that time (an upper bound: the prefill's weight
reads and every wait are left out), `fraction` the measured share of it, and
`roofline_vs_base` its ratio to the base run's: the speedup this machine's limits allow. At
batch 1 decode reads every weight a token; at c sequences a step does c times the work for
about the same bytes, so where the GEMM rate over the bandwidth (FLOP per byte) is small the
allowed speedup is too.
"""

from __future__ import annotations

import argparse

from . import accounting
from .common import (
    add_common,
    apply_threads,
    avoid_ids,
    emit,
    greedy,
    int_list,
    make_llm,
    meta,
    model_dir,
    random_prompts,
    timed,
    with_tp_baseline,
)
from .roofline import add_roofline_args, gemm_gflops, measure


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline tokens/s at several concurrencies")
    add_common(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 32], help="comma list of max_num_seqs values")
    p.add_argument("--no-roofline", dest="roofline", action="store_false", help="skip the roofline columns")
    add_roofline_args(p)
    p.set_defaults(func=main)


def run(args: argparse.Namespace) -> dict:
    levels = sorted(set(args.concurrency))
    need = args.input_len + args.output_len + 1
    llm = make_llm(args, max_num_seqs=levels[-1], max_model_len=max(args.max_model_len, need))
    vocab, avoid = llm.model.config.vocab_size, avoid_ids(llm)
    llm.generate(random_prompts(1, min(args.input_len, 32), vocab, avoid, args.seed - 1), greedy(2), use_tqdm=False)
    sched = llm.engine.scheduler
    rows = []
    for i, c in enumerate(levels):
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, avoid, args.seed + 1000 * (i + 1))
        sched.max_num_seqs = c
        pre = sched.num_preemptions
        wall, outs = timed(lambda: llm.generate(prompts, greedy(args.output_len), use_tqdm=False))
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(p) for p in prompts)
        rows.append(
            {
                "concurrency": c,
                "num_prompts": len(prompts),
                "wall_s": wall,
                "output_tok_s": n_out / wall,
                "total_tok_s": (n_in + n_out) / wall,
                "preemptions": sched.num_preemptions - pre,
            }
        )
    steps = llm.stats()["steps"]
    sizes = accounting.cache_itemsizes(llm)
    llm.shutdown()
    roof = measure(args) if args.roofline else None
    base = rows[0]
    for r in rows:
        r["output_vs_base"] = r["output_tok_s"] / base["output_tok_s"]
        r["total_vs_base"] = r["total_tok_s"] / base["total_tok_s"]
        if roof is not None:  # the base row comes first: its roofline is there for the others
            r.update(_roofline(llm.model, r, args, sizes, roof))
            r["roofline_vs_base"] = r["roofline_output_tok_s"] / base["roofline_output_tok_s"]
    top = rows[-1]
    return {
        "rows": rows,
        "base_concurrency": base["concurrency"],
        "max_concurrency": top["concurrency"],
        "output_tok_s_at_max": top["output_tok_s"],
        "output_speedup_at_max": top["output_vs_base"],
        "total_speedup_at_max": top["total_vs_base"],
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "steps": steps,
        "roofline": roof,
        "meta": meta(args, model_dir(args)),
    }


def _roofline(model, row: dict, args: argparse.Namespace, sizes: dict, roof: dict) -> dict:
    """The run's roofline figures (see module docstring)."""
    bw, gf = roof["bandwidth_gb_s"], gemm_gflops(roof, args.dtype)
    n, P = min(row["concurrency"], row["num_prompts"]), row["num_prompts"]
    step = accounting.decode_step(model, n, args.input_len + args.output_len // 2, **sizes)
    step_s = accounting.roofline_seconds(step["total_bytes"], step["total_flops"], bw, gf)
    prefill = accounting.prefill_flops(model, args.input_len)["total_flops"] * args.input_len * P
    least_s = prefill / (gf * 1e9) + P * (args.output_len - 1) / n * step_s
    out = P * args.output_len / least_s
    return {
        "roofline_output_tok_s": out,
        "fraction": row["output_tok_s"] / out,
        "decode_step_roofline_ms": step_s * 1e3,
        "decode_limit": "memory" if step["total_bytes"] / bw >= step["total_flops"] / gf else "compute",
    }


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    if args.tensor_parallel_size > 1:  # the ranks share this machine's limits: no one-process roofline
        args.roofline = False
    r = with_tp_baseline(args, run, ["output_tok_s_at_max"])
    cols = [
        "concurrency",
        "num_prompts",
        "wall_s",
        "output_tok_s",
        "total_tok_s",
        "output_vs_base",
        "total_vs_base",
        "preemptions",
    ]
    if r["roofline"] is not None:
        cols += ["roofline_output_tok_s", "fraction", "roofline_vs_base", "decode_step_roofline_ms", "decode_limit"]
    return emit(args, r, r["rows"], cols)
