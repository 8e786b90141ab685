"""`deltaserve bench latency`: batch-1 time-to-first-token and decode speed of one request,
each set beside this machine's roofline measured in the same run.

- TTFT: best-of-`reps` wall time of `generate(prompt, max_tokens=1)`; prefill tok/s = L / TTFT;
- decode: one request of `max_tokens=1 + output_len` stepped through the engine, timed from the
  step that produced its first token to the last: `output_len` decode steps (best of `reps`), so
  the prefill's run-to-run noise stays out of it. Greedy, `ignore_eos`, no prefix cache unless
  `--enable-prefix-caching` is given (then the repeats hit it: don't);
- `decode_vs_bandwidth_roofline` = decode tok/s ÷ (bandwidth ÷ bytes read per decode token at
  the mean decode context L + output_len / 2);
- with `--paired N`: N more decode runs, each between two bandwidth readings (best of 2 passes
  each, the roofline's measure), and `paired`: each run's ratio to the mean of its own two
  readings and the median ratio. On a host whose bandwidth moves within seconds this compares
  decode with the bandwidth of the same moment, where the headline pairs best with best;
- `prefill_vs_gemm_roofline` = prefill tok/s ÷ (GEMM FLOP/s of the run's dtype ÷ FLOPs per
  prefill token). Both denominators come from `bench.accounting`.
- with `--tensor-parallel-size N`: `parallel.comm_ms_per_step` (rank 0 inside collectives) and
  `parallel.<key>_vs_tp1` (decode and prefill tok/s over the same run on one process).
"""

from __future__ import annotations

import argparse
import statistics
import time

from . import accounting
from .common import (
    add_common,
    apply_threads,
    avoid_ids,
    emit,
    greedy,
    make_llm,
    meta,
    model_dir,
    random_prompts,
    timed,
    with_tp_baseline,
)
from .roofline import add_roofline_args, bench_device, gemm_gflops, measure, read_bandwidth, stream_tensor


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="batch-1 decode tok/s and TTFT against the roofline")
    add_common(p)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="best-of repetitions of each timed run (the roofline: 5)")
    p.add_argument("--paired", type=int, default=0, help="decode runs each between two bandwidth readings")
    add_roofline_args(p)
    p.set_defaults(func=main)


def _decode_seconds(llm, request_id: str, prompt: list[int], n_out: int) -> float:
    """Wall time of the n_out steps after the first token of one request (engine stepped directly)."""
    engine = llm.engine
    engine.add_request(request_id, prompt, greedy(1 + n_out))
    produced, first = 0, None
    while engine.scheduler.has_work():
        for delta in engine.step_deltas():
            produced += len(delta.token_ids)
        if first is None and produced:
            first = time.perf_counter()
    end = time.perf_counter()
    if produced != 1 + n_out or first is None:
        raise RuntimeError(f"expected {1 + n_out} tokens, got {produced}")
    return max(end - first, 1e-9)


def run(args: argparse.Namespace) -> dict:
    L, n_out = args.prompt_len, args.output_len
    if L < 1 or n_out < 1:
        raise SystemExit("--prompt-len and --output-len must be positive")
    llm = make_llm(args, max_num_seqs=1, max_model_len=max(args.max_model_len, L + n_out + 1))
    vocab = llm.model.config.vocab_size
    prompt = random_prompts(1, L, vocab, avoid_ids(llm), args.seed)[0]
    llm.generate([prompt[: min(L, 32)]], greedy(2), use_tqdm=False)
    ttft = min(timed(lambda: llm.generate([prompt], greedy(1), use_tqdm=False))[0] for _ in range(max(1, args.reps)))
    decode_s = min(_decode_seconds(llm, f"latency-{i}", prompt, n_out) for i in range(max(1, args.reps)))
    full = ttft + decode_s
    sizes = accounting.cache_itemsizes(llm)
    dbytes = accounting.decode_bytes(llm.model, L + n_out // 2, **sizes)
    paired = _paired(llm, prompt, n_out, dbytes["total_bytes"], args) if args.paired > 0 else None
    steps = llm.stats()["steps"]
    llm.shutdown()
    roof = measure(args)
    flops = accounting.prefill_flops(llm.model, L)
    decode_tok_s, prefill_tok_s = n_out / decode_s, L / ttft
    decode_roof = roof["bandwidth_gb_s"] * 1e9 / dbytes["total_bytes"]
    prefill_roof = gemm_gflops(roof, args.dtype) * 1e9 / flops["total_flops"]
    return {
        "decode_tok_s": decode_tok_s,
        "ttft_s": ttft,
        "prefill_tok_s": prefill_tok_s,
        "decode_vs_bandwidth_roofline": decode_tok_s / decode_roof,
        "prefill_vs_gemm_roofline": prefill_tok_s / prefill_roof,
        "decode_roofline_tok_s": decode_roof,
        "prefill_roofline_tok_s": prefill_roof,
        "decode_bytes_per_token": dbytes["total_bytes"],
        "prefill_flops_per_token": flops["total_flops"],
        "decode_s": decode_s,
        "end_to_end_s": full,
        "steps": steps,
        "prompt_len": L,
        "output_len": n_out,
        "bandwidth_gb_s": roof["bandwidth_gb_s"],
        "gemm_gflops": gemm_gflops(roof, args.dtype),
        "decode_bytes": dbytes,
        "prefill_flops": flops,
        "roofline": roof,
        "paired": paired,
        "meta": meta(args, model_dir(args)),
    }


def _paired(llm, prompt: list[int], n_out: int, bytes_per_token: int, args) -> dict:
    """`args.paired` decode runs, each between two readings of the roofline's bandwidth."""
    x = stream_tensor(args.bandwidth_mib, bench_device(args))
    runs = []
    for i in range(args.paired):
        before = max(read_bandwidth(x, 2))
        tok_s = n_out / _decode_seconds(llm, f"paired-{i}", prompt, n_out)
        bw = (before + max(read_bandwidth(x, 2))) / 2
        roof = bw * 1e9 / bytes_per_token
        runs.append({"decode_tok_s": tok_s, "bandwidth_gb_s": bw, "roofline_tok_s": roof, "fraction": tok_s / roof})
    return {"runs": runs, **{f"median_{k}": statistics.median(r[k] for r in runs) for k in runs[0]}}


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    r = with_tp_baseline(args, run, ["decode_tok_s", "prefill_tok_s"])
    rows = [
        {
            "phase": "prefill (TTFT)",
            "measured_tok_s": r["prefill_tok_s"],
            "roofline_tok_s": r["prefill_roofline_tok_s"],
            "fraction": r["prefill_vs_gemm_roofline"],
            "per_token": f"{r['prefill_flops_per_token']:.4g} FLOP",
            "limit": f"{r['gemm_gflops']:.4g} GFLOP/s",
        },
        {
            "phase": "decode",
            "measured_tok_s": r["decode_tok_s"],
            "roofline_tok_s": r["decode_roofline_tok_s"],
            "fraction": r["decode_vs_bandwidth_roofline"],
            "per_token": f"{r['decode_bytes_per_token']:.4g} B",
            "limit": f"{r['bandwidth_gb_s']:.4g} GB/s",
        },
    ]
    if r["paired"] is not None:
        p = r["paired"]
        rows.append(
            {
                "phase": f"decode, paired (median of {len(p['runs'])})",
                "measured_tok_s": p["median_decode_tok_s"],
                "roofline_tok_s": p["median_roofline_tok_s"],
                "fraction": p["median_fraction"],
                "per_token": f"{r['decode_bytes_per_token']:.4g} B",
                "limit": f"{p['median_bandwidth_gb_s']:.4g} GB/s",
            }
        )
    return emit(args, r, rows, ["phase", "measured_tok_s", "roofline_tok_s", "fraction", "per_token", "limit"])
