"""`deltaserve bench kda-scaling`: prefill time at each of `--lengths`, split by layer kind.

One engine (`max_model_len` raised to fit the longest prompt, chunked by
`--max-num-batched-tokens` as the engine does normally) prefills one random prompt per length
(`max_tokens=1`), after a warm-up prefill at the shortest length, in `--repeats` passes that
alternate ascending and descending order (so a drift of the machine's speed hits both ends);
each kind's time per length is its best over the passes. Forward hooks on every decoder layer's
`self_attn` (kind `kda` or `mla`) and FFN (`moe` for `block_sparse_moe`, `mlp` for the dense
MLP) accumulate wall time; `other` is the rest of the `generate` call (embedding, norms, AttnRes
mixes, lm_head, scheduling, sampling).

Per kind: `ratio` = time(Lmax) / time(Lmin) and `linearity` = ratio / (Lmax / Lmin), so 1.0 is
perfectly linear in prompt length and > 1 super-linear (MLA's quadratic term shows here).
`linearity_vs_moe` divides by the MoE's linearity: the MoE's cost is linear by construction, so
this cancels the machine's speed drifting during a long run.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

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
)

KINDS = ("kda", "mla", "moe", "mlp", "other")


class LayerTimer:
    """Accumulates wall time per kind from pre/post forward hooks; `remove()` detaches them."""

    def __init__(self, model):
        cfg = model.config
        self.times: dict[str, float] = defaultdict(float)
        self._start: dict[int, float] = {}
        self._handles = []
        for i, layer in enumerate(model.model.layers):
            self._attach(layer.self_attn, cfg.layer_types[i])
            moe = getattr(layer, "block_sparse_moe", None)
            self._attach(moe if moe is not None else layer.mlp, "moe" if moe is not None else "mlp")

    def _attach(self, module, kind: str) -> None:
        def pre(mod, inputs):
            self._start[id(mod)] = time.perf_counter()

        def post(mod, inputs, output):
            self.times[kind] += time.perf_counter() - self._start.pop(id(mod))

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def reset(self) -> None:
        self.times.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def add_parser(sub) -> None:
    p = sub.add_parser("kda-scaling", help="prefill time per layer kind across prompt lengths")
    add_common(p)
    p.add_argument("--lengths", type=int_list, default=[4096, 8192, 16384, 32768])
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="passes over the lengths (alternating ascending / descending); per kind the best",
    )
    p.set_defaults(func=main)


def _measure(llm, timer: LayerTimer, prompt: list[int]) -> dict:
    timer.reset()
    wall, _ = timed(lambda: llm.generate([prompt], greedy(1), use_tqdm=False))
    row = {"length": len(prompt), "total_s": wall}
    for k in KINDS[:-1]:
        row[f"{k}_s"] = timer.times.get(k, 0.0)
    row["other_s"] = max(wall - sum(row[f"{k}_s"] for k in KINDS[:-1]), 0.0)
    return row


def run(args: argparse.Namespace) -> dict:
    lengths = sorted(set(args.lengths))
    llm = make_llm(args, max_num_seqs=1, max_model_len=max(args.max_model_len, lengths[-1] + 1))
    vocab, avoid = llm.model.config.vocab_size, avoid_ids(llm)
    prompts = {n: random_prompts(1, n, vocab, avoid, args.seed + i)[0] for i, n in enumerate(lengths)}
    llm.generate(random_prompts(1, lengths[0], vocab, avoid, args.seed - 1), greedy(1), use_tqdm=False)
    timer = LayerTimer(llm.model)
    best: dict[int, dict] = {}
    try:
        for rep in range(max(1, args.repeats)):
            for n in lengths if rep % 2 == 0 else lengths[::-1]:
                row = _measure(llm, timer, prompts[n])
                prev = best.setdefault(n, row)
                for key in row:
                    prev[key] = min(prev[key], row[key])
    finally:
        timer.remove()
    rows = [dict(best[n], tok_s=n / best[n]["total_s"]) for n in lengths]
    lo, hi = rows[0], rows[-1]
    scale = hi["length"] / lo["length"]
    ratio, linearity = {}, {}
    for k in (*KINDS, "total"):
        if lo[f"{k}_s"] > 0:
            ratio[k] = hi[f"{k}_s"] / lo[f"{k}_s"]
            linearity[k] = ratio[k] / scale
    moe = linearity.get("moe")
    vs_moe = {k: v / moe for k, v in linearity.items()} if moe else {}
    return {
        "rows": rows,
        "lengths": lengths,
        "length_ratio": scale,
        "ratio": ratio,
        "linearity": linearity,
        "kda_linearity": linearity.get("kda"),
        "mla_linearity": linearity.get("mla"),
        "linearity_vs_moe": vs_moe,
        "max_num_batched_tokens": llm.engine.scheduler.max_num_batched_tokens,
        "meta": meta(args, model_dir(args)),
    }


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    r = run(args)
    cols = ["length", "total_s", "tok_s", *(f"{k}_s" for k in KINDS)]
    rows = list(r["rows"])
    rows.append({"length": "ratio", **{f"{k}_s": v for k, v in r["ratio"].items()}})
    rows.append({"length": "linearity", **{f"{k}_s": v for k, v in r["linearity"].items()}})
    return emit(args, r, rows, cols)
