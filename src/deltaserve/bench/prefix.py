"""`deltaserve bench prefix`: replay the agentic workload with deltaserve's prefix cache and with
a simulated vLLM-style policy on the same engine, and compare prefill work against the ideal.

The vLLM-style baseline (spec/serving.md §3.3-3.7) keeps KDA states only at 1536-token block ends
and at the prompt's last 128-token hash boundary, with 128-token partial hits and no junction or
turn-end checkpoints. Both runs use identical weights, prompts, memory budget, greedy decoding and
scheduler (which holds a request while an older one prefills their shared prefix: `held` counts
request-steps held), so the difference is the retention/matching policy alone.

`--tiers`: deltaserve's policy on a device pool far smaller than the workload (`working_set_x`:
the distinct tokens' MLA rows plus one KDA state per session, over the pool), without and with
a host tier and a disk tier under it, side by side (`tier_hits`: restores from host / disk);
with `--kv-store mooncake://HOST:PORT` also with the shared store alone under the device (the
engine lends it the memory; `tier_hits`: restores from the store).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from .workload import WorkloadSpec, build_sessions, ideal_computed


@dataclass(frozen=True)
class PolicyRun:
    name: str
    unit: int
    policy: str
    interval: int | None


OURS = PolicyRun("deltaserve", 16, "default", 1024)
VLLM_LIKE = PolicyRun("vllm-style", 128, "prompt-end", 1536)


def replay(
    model: str,
    run: PolicyRun,
    spec: WorkloadSpec,
    answer_tokens: int,
    kv_cache_memory: int,
    dtype: str,
    max_num_seqs: int | None = None,
    max_model_len: int = 32768,
    **tiers,
) -> dict:
    """One replay; `tiers`: the engine's tier settings (`kv_offload_memory`, `kv_disk_path`, ...)."""
    from ..engine.llm import LLM
    from ..engine.request.sampling_params import SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        max_num_seqs=max_num_seqs or spec.sessions,
        max_num_batched_tokens=4096,
        page_size=16,
        kv_cache_memory=kv_cache_memory,
        max_model_len=max_model_len,
        progress=False,
        enable_prefix_caching=True,
        prefix_match_unit=run.unit,
        kda_checkpoint_policy=run.policy,
        kda_checkpoint_interval=run.interval,
        checkpoint_fraction=0.3,
        **tiers,
    )
    avoid = set(llm.engine.eos_ids) | set(llm.tokenizer.special_ids if llm.tokenizer else ())
    sessions = build_sessions(spec, llm.model.config.vocab_size, avoid)
    params = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    seen: list[list[int]] = []
    ideal = prompt_tokens = 0
    t0 = time.perf_counter()
    for r in range(spec.rounds):
        prompts = [s.history + s.turns[r] for s in sessions]
        ideal += ideal_computed(prompts, seen)
        prompt_tokens += sum(len(p) for p in prompts)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for s, p, o in zip(sessions, prompts, outs):
            s.history = p + o.outputs[0].token_ids
            seen.append(s.history)
    wall = time.perf_counter() - t0
    llm.check_integrity()
    stats = llm.stats()
    pc = stats["prefix_cache"]
    computed = prompt_tokens - pc["hit_tokens"]
    slot_bytes = llm.cache.kda.states[:, 0].nbytes + llm.cache.kda.tails[:, 0].nbytes
    row_bytes = llm.cache.mla.storage[:, 0].nbytes // llm.cache.page_size
    working = ideal_computed([s.history for s in sessions], []) * row_bytes + len(sessions) * slot_bytes
    t = pc.get("tiers", {})
    names = [k for k in ("host", "disk", "store") if k in t]
    llm.shutdown()
    return {
        "policy": run.name + (" + " + "/".join(names) if names else ""),
        "working_set_x": working / kv_cache_memory,
        "tier_hits": "/".join(str(t[k]["hits"]) for k in names) or "-",
        "prompt_tokens": prompt_tokens,
        "computed": computed,
        "ideal": ideal,
        "computed_over_ideal": computed / ideal,
        "hit_rate": pc["hit_tokens"] / prompt_tokens,
        "hits": pc["hits"],
        "queries": pc["queries"],
        "retention_misses": pc["retention_misses"],
        "checkpoints": pc["checkpoints"],
        "held": pc["inflight_waits"],
        "state_pool_share": pc["checkpoint_slots_used"] * slot_bytes / kv_cache_memory,
        "wall_s": wall,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("prefix", help="prefix-cache replay: deltaserve vs a vLLM-style policy")
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. make-tiny output)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=int, default=2 * 2**30)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --sessions")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument(
        "--tiers",
        action="store_true",
        help="deltaserve alone vs with a host tier (2x --kv-cache-memory) and a disk tier (a temporary directory)",
    )
    p.add_argument(
        "--kv-store",
        default=None,
        metavar="mooncake://HOST:PORT",
        help="with --tiers: also a run with this shared store alone under the device (lending it 8 GiB)",
    )
    p.set_defaults(func=main)


def tier_rows(args: argparse.Namespace, spec: WorkloadSpec) -> list[dict]:
    """deltaserve's policy without and with host + disk tiers, on the same device pool."""
    import tempfile

    common = (args.model, OURS, spec, args.answer_tokens, args.kv_cache_memory, args.dtype, args.max_num_seqs)
    common += (args.max_model_len,)
    with tempfile.TemporaryDirectory(prefix="deltaserve-bench-tiers-") as disk:
        tiers = dict(kv_offload_memory=2 * args.kv_cache_memory, kv_disk_path=disk, kv_disk_size=8 << 30)
        rows = [replay(*common), replay(*common, **tiers)]
    if args.kv_store is not None:
        rows.append(replay(*common, kv_store=args.kv_store, kv_store_size=8 << 30))
    return rows


def main(args: argparse.Namespace) -> int:
    spec = WorkloadSpec(sessions=args.sessions, rounds=args.rounds, seed=args.seed)
    if args.tiers:
        rows = tier_rows(args, spec)
    else:
        rows = [
            replay(
                *(args.model, run, spec, args.answer_tokens, args.kv_cache_memory, args.dtype, args.max_num_seqs),
                args.max_model_len,
            )
            for run in (OURS, VLLM_LIKE)
        ]
    cols = [
        "policy",
        "working_set_x",
        "tier_hits",
        "prompt_tokens",
        "computed",
        "ideal",
        "computed_over_ideal",
        "hit_rate",
        "hits",
        "queries",
        "retention_misses",
        "checkpoints",
        "held",
        "state_pool_share",
        "wall_s",
    ]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    ours = rows[0]
    for base in rows[1:]:
        print(
            f"prefill tokens computed: {ours['policy']} {ours['computed']} vs {base['policy']} {base['computed']} "
            f"({base['computed'] / ours['computed']:.2f}x); ideal {ours['ideal']}"
        )
    return 0
