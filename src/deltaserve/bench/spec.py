"""`deltaserve bench spec`: decode tokens/s with and without speculative decoding, in one run.

Two workloads at each batch size (default 1 and 8): copy-heavy (a passage, then its first part
again, as an edit re-sends text: a trained model continues the copy, which drafts catch) and
free-form (random prompt tokens: drafts rarely match, so adaptive k should leave the speed as it
was). Both engines share every setting but `speculative_config`; prefix caching is off so repeats
measure the engine. `--method draft_model` drafts with the checkpoint `--draft-model` (default: the
target itself, an upper bound on acceptance that costs a second full forward per draft). Greedy,
`--output-tokens` per request with EOS ignored; each configuration runs once to warm up, then
`--repeats` times, the best wall time kept. It reports whether the tokens with speculation equal
those without (they must, at temperature 0)."""

from __future__ import annotations

import argparse
import json
import random
import time


def workloads(vocab: int, passage: int, batch: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    out: dict[str, list[list[int]]] = {"copy": [], "free": []}
    for _ in range(batch):
        text = [rng.randrange(vocab) for _ in range(passage)]
        out["copy"].append(text + text[: passage // 4])
        out["free"].append([rng.randrange(vocab) for _ in range(passage + passage // 4)])
    return out


def timed(llm, prompts: list[list[int]], params, repeats: int) -> tuple[float, list[list[int]]]:
    """(best tokens/s over `repeats` after one warm-up, the tokens)."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / best, tokens


def run(args: argparse.Namespace) -> list[dict]:
    from ..engine.llm import LLM
    from ..engine.request.sampling_params import SamplingParams

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "draft_model":
        spec["model"] = args.draft_model or args.model
    common = dict(
        dtype=args.dtype,
        max_num_seqs=max(sizes),
        max_model_len=2 * args.passage_tokens + args.output_tokens + 16,
        enable_prefix_caching=False,
        progress=False,
    )
    engines = {"off": LLM(args.model, **common), "on": LLM(args.model, speculative_config=spec, **common)}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    vocab = engines["off"].model.config.vocab_size
    rows = []
    for batch in sizes:
        for name, prompts in workloads(vocab, args.passage_tokens, batch, args.seed).items():
            before = engines["on"].stats()["spec_decode"]
            off, want = timed(engines["off"], prompts, params, args.repeats)
            on, got = timed(engines["on"], prompts, params, args.repeats)
            after = engines["on"].stats()["spec_decode"]
            drafts = after["drafts"] - before["drafts"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            rows.append(
                dict(
                    workload=name,
                    batch=batch,
                    tok_s_off=off,
                    tok_s_on=on,
                    speedup=on / off,
                    mean_accepted_length=1 + accepted / drafts if drafts else 0.0,
                    same_tokens=got == want,
                )
            )
    return rows


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="decode tokens/s with and without speculative decoding (copy-heavy, free-form)")
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. make-tiny output)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix", "draft_model"])
    p.add_argument("--draft-model", help="draft_model's checkpoint directory (default: --model itself)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--passage-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    rows = run(args)
    if args.json:
        print(json.dumps({"rows": rows}))
        return 0
    cols = ["workload", "batch", "tok_s_off", "tok_s_on", "speedup", "mean_accepted_length", "same_tokens"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    return 0 if all(r["same_tokens"] for r in rows) else 1
