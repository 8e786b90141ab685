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

Decode tokens/s = (tokens - one per request) / the time from the step that gave the last request
its first token to the step that finished the last one, timed inside each run (the prompts are
rendered once before; rendering, prefill and the first token are not counted). Off and on run
in pairs, back to back, in turn first and last, after a warm-up pair: a row's rates are each
engine's best of `--repeats` runs, its speedup the median of the pairs' ratios (the machine's
speed drifts between phases that last several runs; a pair shares one).
Every row reports the mean accepted length and acceptance rate of its timed runs and whether the
tokens with speculation equal those without (they must at temperature 0; exit 1 otherwise)."""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

from .common import apply_threads, emit, meta, model_dir


def conversations(kind: str, batch: int, seed: int, sentences: int) -> list[list[dict]]:
    """`batch` one-message chats of the workload `kind` ("copy" or "free")."""
    from ..train.tasks import arithmetic, copy_edit

    rng = random.Random(seed)
    if kind == "copy":
        return [copy_edit(rng, sentences).messages for _ in range(batch)]
    return [arithmetic(rng).messages for _ in range(batch)]


def prompts(llm, convs) -> list[list[int]]:
    """The conversations as the chat endpoint renders them (K3: thinking on), token ids."""
    from ..chat.render import load_chat_template
    from ..engine.request.chat_inputs import chat_prompt

    render = dict(add_generation_prompt=True, thinking=True, chat_template=load_chat_template(llm.config.model) or None)
    return [chat_prompt(llm.tokenizer, llm.model.config.family, c, **render)["prompt_token_ids"] for c in convs]


_ids = itertools.count()  # request ids of the timed runs


def decode_run(llm, ids: list[list[int]], params) -> tuple[float, int, list[list[int]]]:
    """One generation of `ids` on `llm`'s engine, stepped here: (decode seconds, decode tokens, the
    tokens), decode as the module docstring defines it."""
    engine = llm.engine
    rids = [f"bench-spec-{next(_ids)}" for _ in ids]
    for rid, prompt in zip(rids, ids):
        engine.add_request(rid, prompt, params)
    seqs = [engine.requests[rid].seqs[0] for rid in rids]
    start = None
    while engine.has_unfinished():
        engine.step()
        if start is None and all(s.output_ids for s in seqs):
            start = time.perf_counter()
    tokens = [list(s.output_ids) for s in seqs]
    return time.perf_counter() - start, sum(map(len, tokens)) - len(tokens), tokens


def decode_rates(engines: list, ids: list[list[int]], params, repeats: int) -> tuple[list[float], float, list]:
    """(each engine's best decode tokens/s, the median over runs of the last's rate over the
    first's, each engine's tokens): the engines run back to back `repeats` times after a warm-up,
    in turn first and last (so neither always follows the other)."""
    best = [0.0] * len(engines)
    ratios: list[float] = []
    outs: list = [None] * len(engines)
    for r in range(repeats + 1):
        rates = [0.0] * len(engines)
        for i in range(len(engines)) if r % 2 else reversed(range(len(engines))):
            seconds, n, outs[i] = decode_run(engines[i], ids, params)
            rates[i] = n / max(seconds, 1e-9)
        if r:  # the first round warms up
            best = [max(b, x) for b, x in zip(best, rates)]
            ratios.append(rates[-1] / rates[0])
    return best, statistics.median(ratios), outs


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


def row(name: str, batch: int, off, on, ids, params, repeats: int) -> dict:
    """One row: `off` and `on` over the same prompts."""
    before = on.stats()["spec_decode"]
    (rate_off, rate_on), speedup, (want, got) = decode_rates([off, on], ids, params, repeats)
    return dict(
        workload=name,
        batch=batch,
        tok_s_off=rate_off,
        tok_s_on=rate_on,
        speedup=speedup,
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
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        e = engines(args, batch)
        work = {
            kind: prompts(e["off"], conversations(kind, batch, args.seed, args.sentences)) for kind in ("copy", "free")
        }
        for kind, ids in work.items():
            rows.append(row(kind, batch, e["off"], e["on"], ids, params, args.repeats))
        if "resend" in e:
            decode_run(e["resend"], work["copy"], params)  # the first send fills the session store
            rows.append(row("copy-resend", batch, e["off"], e["resend"], work["copy"], params, args.repeats))
            rows.append(row("copy-self", batch, e["off"], e["self"], work["copy"], params, args.repeats))
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
    p.add_argument(
        "--num-speculative-tokens", type=int, default=7, help="the most drafts a step (adaptive k picks per request)"
    )
    p.add_argument("--sentences", type=int, default=6, help="sentences of each copy passage (~14 tokens each)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-extra-rows", action="store_true", help="no resend and self rows at batch 1")
    p.add_argument("--no-adaptive", action="store_true", help="--method drafts k every step (adaptive k off)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.output_tokens < 2 or args.repeats < 1:
        raise SystemExit("bench spec: --output-tokens must be at least 2 and --repeats at least 1")
    args.model = str(model_dir(args))
    apply_threads(args)
    rows = run(args)
    emit(args, {"meta": meta(args, args.model), "rows": rows}, rows, COLS)
    return 0 if all(r["same_tokens"] for r in rows) else 1
