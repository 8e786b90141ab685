"""`deltaserve bench spec`: batch decode tokens/s with and without speculative decoding, in one run.

Workloads (chat requests of the curriculum's tasks, train/tasks.py, so a trained model answers them
as it was taught): `copy` asks to repeat a passage of `--sentences` sentences exactly or with one
noun replaced (an edit of a passage: the answer repeats most of the prompt), `free` asks
arithmetic questions (the answer and its working are not in the prompt). Greedy, up to
`--output-tokens` a request, stopping at EOS as a client would.

Rows at each batch size: both workloads, `--method` on vs off (with suffix, its session store off:
the rows measure a first send; `--no-adaptive`: k drafts whenever the drafter has them). At
batch 1 two more copy rows: `resend` (the same requests sent a second time, suffix drafts with
the session store holding the first answers: what an agent's re-sent edit gets) and `self`
(draft_model with the target as its own draft, adaptive k off: acceptance ~1, so it shows what
verification and a target-sized drafter cost, apart from how well the model copies). Every
engine shares every other setting; prefix caching is off.

Decode tokens/s = (tokens - one per request) / (time of the whole generation - time of a
generation of one token), each the best of `--repeats` after a warm-up, off and on interleaved:
prefill is not counted.
Every row reports the mean accepted length and acceptance rate of its timed runs and whether the
tokens with speculation equal those without (they must at temperature 0; exit 1 otherwise)."""

from __future__ import annotations

import argparse
import random
import time

from .common import emit, meta, model_dir


def conversations(kind: str, batch: int, seed: int, sentences: int) -> list[list[dict]]:
    """`batch` one-message chats of the workload `kind` ("copy" or "free")."""
    from ..train.tasks import arithmetic, copy_edit

    rng = random.Random(seed)
    if kind == "copy":
        return [copy_edit(rng, sentences).messages for _ in range(batch)]
    return [arithmetic(rng).messages for _ in range(batch)]


def _timed(llm, convs, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def decode_rates(engines: list, convs, params, first, repeats: int) -> list[tuple[float, list[list[int]]]]:
    """Per engine (decode tokens/s: generated tokens past each request's first over the time they
    added, the tokens), the engines' runs interleaved (a load that comes and goes hits them alike),
    each time the best of `repeats` after a warm-up."""
    best = [[float("inf"), float("inf")] for _ in engines]
    outs: list = [None] * len(engines)
    for r in range(repeats + 1):
        for i, llm in enumerate(engines):
            t_first, _ = _timed(llm, convs, first)
            t_all, outs[i] = _timed(llm, convs, params)
            if r:  # the first round warms up
                best[i] = [min(best[i][0], t_first), min(best[i][1], t_all)]
    rates = []
    for (t_first, t_all), o in zip(best, outs):
        tokens = [list(x.outputs[0].token_ids) for x in o]
        rates.append(((sum(map(len, tokens)) - len(tokens)) / max(t_all - t_first, 1e-9), tokens))
    return rates


def _spec_delta(llm, before: dict) -> dict:
    after = llm.stats()["spec_decode"]
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    return dict(
        mean_accepted_length=1 + accepted / drafts if drafts else 0.0,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        drafted_steps=drafts,
    )


def row(name: str, batch: int, off, on, convs, params, first, repeats: int) -> dict:
    """One row: `off` and `on` over the same conversations."""
    before = on.stats()["spec_decode"]
    (rate_off, want), (rate_on, got) = decode_rates([off, on], convs, params, first, repeats)
    return dict(
        workload=name,
        batch=batch,
        tok_s_off=rate_off,
        tok_s_on=rate_on,
        speedup=rate_on / rate_off,
        **_spec_delta(on, before),
        out_tokens=sum(map(len, want)),
        same_tokens=got == want,
    )


def engines(args: argparse.Namespace, batch: int) -> dict:
    """The engines of the run: off, on (`--method`), and at batch 1 resend (suffix) and self."""
    from ..engine.llm import LLM

    common = dict(dtype=args.dtype, max_num_seqs=batch, max_model_len=1024, enable_prefix_caching=False, progress=False)
    k = args.num_speculative_tokens
    spec = {"method": args.method, "num_speculative_tokens": k}
    if args.method == "draft_model":
        spec["model"] = args.draft_model or args.model
    if args.method == "suffix":
        spec["suffix_cache_requests"] = 0
    if args.no_adaptive:
        spec["adaptive"] = False
    out = {"off": LLM(args.model, **common), "on": LLM(args.model, speculative_config=spec, **common)}
    if batch == 1 and not args.no_extra_rows:
        resend = {"method": "suffix", "num_speculative_tokens": k}
        own = {"method": "draft_model", "num_speculative_tokens": k, "model": args.model, "adaptive": False}
        out["resend"] = LLM(args.model, speculative_config=resend, **common)
        out["self"] = LLM(args.model, speculative_config=own, **common)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    from ..engine.request.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        e = engines(args, batch)
        work = {kind: conversations(kind, batch, args.seed, args.sentences) for kind in ("copy", "free")}
        for kind, convs in work.items():
            rows.append(row(kind, batch, e["off"], e["on"], convs, params, first, args.repeats))
        if "resend" in e:
            e["resend"].chat(work["copy"], params, use_tqdm=False)  # the first send fills the session store
            rows.append(row("copy-resend", batch, e["off"], e["resend"], work["copy"], params, first, args.repeats))
            rows.append(row("copy-self", batch, e["off"], e["self"], work["copy"], params, first, args.repeats))
        for llm in e.values():
            llm.shutdown()
    return rows


COLS = [
    "workload",
    "batch",
    "tok_s_off",
    "tok_s_on",
    "speedup",
    "mean_accepted_length",
    "acceptance_rate",
    "out_tokens",
    "same_tokens",
]


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="decode tokens/s with and without speculative decoding (copy-heavy, free-form)")
    p.add_argument("--model", help="a chat checkpoint directory (default: the default served model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--method", default="ngram", choices=["ngram", "suffix", "draft_model"])
    p.add_argument("--draft-model", help="draft_model's checkpoint directory (default: --model itself)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--sentences", type=int, default=6, help="sentences of each copy passage (~14 tokens each)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-extra-rows", action="store_true", help="no resend and self rows at batch 1")
    p.add_argument("--no-adaptive", action="store_true", help="--method drafts k every step (adaptive k off)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    args.model = str(model_dir(args))
    rows = run(args)
    emit(args, {"meta": meta(args, args.model), "rows": rows}, rows, COLS)
    return 0 if all(r["same_tokens"] for r in rows) else 1
