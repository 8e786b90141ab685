"""Min times of a speculative verify's pieces on the native CPU path (docs/performance.md, "Rollback
by replay"): a plain decode step (1 row), a chained verify call of k + 1 rows (with its slot copy),
and its fold with 1..k verified tokens (a rollback of k..1 drafts), on the default model, bf16,
batch 1. Run it pinned (`taskset -c 0`) and compare builds in one session (PYTHONPATH=<tree>/src):
only ratios within a session mean anything on a shared machine.

    python scripts/spec_rollback_bench.py [--rounds 200] [--context 200] [-k 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve.engine.exec.chained_verify import ChainedVerify, rows_of
from deltaserve.engine.exec.messages import Step
from deltaserve.engine.exec.step_batch import forward_batch
from deltaserve.engine.llm import LLM
from deltaserve.serve import default_model_dir


def _prefill(model, cache, n: int, gen: torch.Generator) -> tuple[list[int], int]:
    """A sequence of n random tokens prefilled: (its pages, its slot)."""
    assert cache.admit(1, n + 16)
    c = cache.seqs[1]
    prompt = torch.randint(model.config.vocab_size, (n,), generator=gen).tolist()
    step = Step([], prompt, [0], [n], [list(c.pages)], [c.slot], None, [], [n - 1])
    batch = forward_batch(step, cache.mla, cache.kda, cache.ckpt_pool, model.device)
    model(batch.input_ids, batch.context())
    return list(c.pages), c.slot


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("-k", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(str(default_model_dir()), dtype="bfloat16", max_num_seqs=1, max_model_len=1024, progress=False)
    model, cache = llm.engine.runner.model, llm.engine.runner.cache
    gen = torch.Generator().manual_seed(0)
    n, k = args.context, args.k
    pages, slot = _prefill(model, cache, n, gen)
    idx = torch.tensor([slot])
    pre = cache.kda.tails.index_select(1, idx).clone(), cache.kda.states.index_select(1, idx).clone()

    def restore():
        cache.kda.tails.index_copy_(1, idx, pre[0])
        cache.kda.states.index_copy_(1, idx, pre[1])

    ids = torch.randint(model.config.vocab_size, (k + 1,), generator=gen).tolist()
    verify = Step([], ids, [n], [k + 1], [pages], [slot], None, [], list(range(k + 1)), verify=[True])
    one = Step([], ids[:1], [n], [1], [pages], [slot], None, [], [0])
    decode, call, fold = [], [], {v: [] for v in range(1, k + 1)}
    for _ in range(args.rounds):
        restore()
        t0 = time.perf_counter()
        batch = forward_batch(one, cache.mla, cache.kda, cache.ckpt_pool, model.device)
        model.decode_logits(batch.input_ids, batch.context())
        decode.append(time.perf_counter() - t0)
        for v in fold:
            restore()
            t0 = time.perf_counter()
            chained = ChainedVerify(verify, rows_of(verify), [True], cache)
            chained.logits(model)
            t1 = time.perf_counter()
            chained.fold(model, [v])
            fold[v].append(time.perf_counter() - t1)
            call.append(t1 - t0)
    step = min(decode)
    print(f"decode (1 row) {step * 1e3:.3f} ms; verify call ({k + 1} rows, slot copy) {min(call) * 1e3:.3f} ms")
    for v, times in fold.items():
        print(f"fold, {v} of {k + 1} verified: {min(times) * 1e3:.3f} ms = {min(times) / step:.2f} decode steps")


if __name__ == "__main__":
    main()
