"""`deltaserve bench vs-reference`: one greedy workload (`--num-prompts` random prompts of
`--input-len` tokens, `--output-len` new tokens each, no early stop) through

- the engine: one `LLM.generate` call holding every prompt (continuous batching);
- the naive reference: `KimiForCausalLM.forward_full` over the whole sequence at every step
  (no cache), argmax of the last row, prompt by prompt, on the engine's own module (identical
  weights by construction);
- Hugging Face `transformers` (Kimi-Linear only: it ships `kimi_linear`; there is no
  transformers class for `kimi_k3`): `generate` with greedy decoding and no EOS, one batch of
  all prompts (equal lengths, so no padding), loaded from the same checkpoint in the run's dtype.

Reports wall time and tok/s of each, `speedup_vs_*` = their time ÷ the engine's, and
`agreement_vs_*` = fraction of positions where the generated token equals the engine's.
Defaults to fp32, where agreement should be exactly 1.0.
"""

from __future__ import annotations

import argparse

from .common import add_common, apply_threads, avoid_ids, emit, greedy, make_llm, meta, model_dir, random_prompts, timed


def add_parser(sub) -> None:
    p = sub.add_parser("vs-reference", help="engine vs naive forward_full loop vs transformers")
    add_common(p, dtype="float32")
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers run")
    p.set_defaults(func=main)


def naive_generate(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding by recomputing `forward_full` over the whole sequence for every token."""
    import torch

    out = []
    for p in prompts:
        seq = list(p)
        for _ in range(n):
            seq.append(int(model.forward_full(torch.tensor(seq, dtype=torch.long))[-1].argmax()))
        out.append(seq[len(p) :])
    return out


def transformers_generate(path, dtype_name: str, prompts: list[list[int]], n: int):
    """(tokens, seconds) from HF `generate`, or (None, reason) if transformers can't run it."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    import copy

    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
    model.train(False)
    gen = copy.deepcopy(model.generation_config)
    gen.update(do_sample=False, eos_token_id=None, temperature=None, top_p=None, top_k=None)
    warm = copy.deepcopy(gen)
    warm.update(max_new_tokens=2)
    gen.update(max_new_tokens=n)
    ids = torch.tensor(prompts, dtype=torch.long)
    with torch.no_grad():
        model.generate(ids[:, :8], generation_config=warm, attention_mask=torch.ones_like(ids[:, :8]))
        t, out = timed(lambda: model.generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids)))
    return out[:, ids.shape[1] :].tolist(), t


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    total = sum(len(r) for r in a)
    return sum(x == y for x, y in pairs) / total if total else 1.0


def run(args: argparse.Namespace) -> dict:
    n_out = args.output_len
    path = model_dir(args)
    llm = make_llm(
        args, max_num_seqs=max(1, args.num_prompts), max_model_len=max(args.max_model_len, args.input_len + n_out + 1)
    )
    cfg = llm.model.config
    prompts = random_prompts(args.num_prompts, args.input_len, cfg.vocab_size, avoid_ids(llm), args.seed)
    llm.generate([prompts[0][:8]], greedy(2), use_tqdm=False)
    t_engine, outs = timed(lambda: llm.generate(prompts, greedy(n_out), use_tqdm=False))
    engine = [list(o.outputs[0].token_ids) for o in outs]
    naive_generate(llm.model, [prompts[0][:8]], 2)
    t_naive, naive = timed(lambda: naive_generate(llm.model, prompts, n_out))
    total = n_out * len(prompts)
    r = {
        "family": cfg.family,
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": n_out,
        "engine_s": t_engine,
        "engine_tok_s": total / t_engine,
        "reference_s": t_naive,
        "reference_tok_s": total / t_naive,
        "speedup_vs_reference": t_naive / t_engine,
        "agreement_vs_reference": agreement(engine, naive),
        "transformers_available": False,
        "transformers_reason": None,
        "transformers_s": None,
        "transformers_tok_s": None,
        "speedup_vs_transformers": None,
        "agreement_vs_transformers": None,
    }
    if cfg.family != "kimi_linear":
        r["transformers_reason"] = f"transformers has no model class for {cfg.family}"
    elif args.no_transformers:
        r["transformers_reason"] = "skipped (--no-transformers)"
    else:
        toks, t = transformers_generate(path, args.dtype, prompts, n_out)
        if toks is None:
            r["transformers_reason"] = t
        else:
            r.update(
                transformers_available=True,
                transformers_s=t,
                transformers_tok_s=total / t,
                speedup_vs_transformers=t / t_engine,
                agreement_vs_transformers=agreement(engine, toks),
            )
    r["meta"] = meta(args, path)
    return r


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    r = run(args)
    rows = [
        {
            "path": "engine",
            "seconds": r["engine_s"],
            "tok_s": r["engine_tok_s"],
            "speedup_of_engine": 1.0,
            "agreement": 1.0,
        },
        {
            "path": "forward_full loop",
            "seconds": r["reference_s"],
            "tok_s": r["reference_tok_s"],
            "speedup_of_engine": r["speedup_vs_reference"],
            "agreement": r["agreement_vs_reference"],
        },
    ]
    if r["transformers_available"]:
        rows.append(
            {
                "path": "transformers",
                "seconds": r["transformers_s"],
                "tok_s": r["transformers_tok_s"],
                "speedup_of_engine": r["speedup_vs_transformers"],
                "agreement": r["agreement_vs_transformers"],
            }
        )
    return emit(args, r, rows, ["path", "seconds", "tok_s", "speedup_of_engine", "agreement"])
