"""The K3 channel guard's cost per generated token (server/channel_guard.py): the random tiny K3
generates the same chat prompt with the guard's grammar and without, rounds alternating, and
the script prints seconds per generated token of each and their ratio (guarded / unguarded).
`--tokenizer-ranks` builds the model on Moonshot's base ranks (the real 163,840-id vocabulary,
which the grammar's token mask spans).

    python scripts/channel_guard_bench.py --batch 8 --max-tokens 64 --rounds 3 \
        [--tokenizer-ranks ../shared/tokenizers/kimi-base-ranks.tiktoken]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from deltaserve import LLM, SamplingParams
from deltaserve.chat.render import render_chat
from deltaserve.server.channel_guard import channel_guard
from deltaserve.server.parsers import control_token_ids
from deltaserve.tiny import make_tiny

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def one_round(llm: LLM, ids: list[int], batch: int, max_tokens: int, guard: bool, seed: int) -> tuple[int, float]:
    """(generated tokens, seconds) of `batch` sequences, thinking on, tools declared."""
    keep = control_token_ids(llm.tokenizer, "kimi_k3")
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed + i,
            keep_special_token_ids=keep,
            structured=channel_guard(True, ["get_weather"]) if guard else None,
        )
        for i in range(batch)
    ]
    t0 = time.perf_counter()
    outs = llm.generate([ids] * batch, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokenizer-ranks", default=None)
    args = ap.parse_args()
    ckpt = make_tiny(tempfile.mkdtemp(), family="kimi_k3", vision=False, tokenizer_ranks=args.tokenizer_ranks)
    llm = LLM(
        ckpt, dtype="float32", max_num_seqs=args.batch, kv_cache_memory=64 * 2**20, max_model_len=1024, progress=False
    )
    ids = render_chat(llm.tokenizer, "kimi_k3", USER, tools=TOOLS, thinking=True)
    for guard in (False, True):  # warm-up: compile paths, build the grammar's token tables
        one_round(llm, ids, args.batch, 8, guard, 10_000)
    totals = {False: [0, 0.0], True: [0, 0.0]}
    for r in range(args.rounds):
        for guard in (False, True) if r % 2 == 0 else (True, False):
            n, s = one_round(llm, ids, args.batch, args.max_tokens, guard, 100 * r)
            totals[guard][0] += n
            totals[guard][1] += s
    per = {g: s / n for g, (n, s) in totals.items()}
    vocab = llm.tokenizer.vocab_size if hasattr(llm.tokenizer, "vocab_size") else "?"
    print(f"vocabulary {vocab}, batch {args.batch}, {args.rounds} rounds")
    for g in (False, True):
        print(f"guard {'on ' if g else 'off'}: {totals[g][0]} tokens, {per[g] * 1e3:.2f} ms/token")
    print(f"ratio on/off: {per[True] / per[False]:.3f}")


if __name__ == "__main__":
    main()
