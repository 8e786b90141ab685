"""`deltaserve plan`: the memory plan (`cache.plan`) as text or one JSON object. Bad layouts and
configs exit 2 with one `deltaserve plan: error: ...` line on stderr. The engine flags' defaults
(`EngineSettings`) come from the caller: `cli` passes `EngineConfig`'s."""

from __future__ import annotations

import argparse
import json
import sys

from ..model.config import ConfigError
from .plan import KV_DTYPES, MODEL_DTYPES, STATE_DTYPES, Layout, PlanError, load_config, parse_bytes, plan
from .plan_engine import EngineSettings, load_vision_config

_LABELS = {
    "attention_dense": "attention + dense",
    "shared_experts": "shared experts",
    "routed_experts": "routed experts",
    "embeddings": "embedding + lm_head",
    "vision": "vision tower",
}


def _size(b: float) -> str:
    if abs(b) < 2**20:
        return f"{b / 2**10:,.1f} KiB"
    return f"{b / 2**20:,.1f} MiB" if abs(b) < 2**30 else f"{b / 2**30:,.2f} GiB"


def _sharding(group: str, p: dict) -> str:
    lay, m = p["layout"], p["model"]
    tp = f"TP{lay['tensor_parallel_size']}"
    if group == "routed_experts":
        fmt = "MXFP4 4.25 b/w" if m["routed_experts_quantization"] == "mxfp4" else "bf16"
        if lay["wide_expert_parallel"]:
            dp = f"DP{lay['data_parallel_size']}"
            return f"{fmt}; {lay['experts_per_rank']} of {m['experts']} experts per rank (wide EP over {dp} x {tp})"
        if lay["expert_parallel"]:
            return f"{fmt}; {lay['experts_per_rank']} of {m['experts']} experts per rank (EP over {tp})"
        return f"{fmt}; width split {tp}"
    return {
        "attention_dense": f"heads/width split {tp}; norms, router, low-rank, latent MoE replicated",
        "shared_experts": f"width split {tp}",
        "embeddings": f"vocab split {tp}",
        "vision": "rank 0 only (tower + projector)",
    }[group]


def render(p: dict) -> str:
    """Human-readable form of a `plan()` dict."""
    m, lay, kda = p["model"], p["layout"], p["kda_state_per_request"]
    dcp = lay["decode_context_parallel_size"]
    lines = [
        f"{m['family']}: {m['layers']} layers = {m['kda_layers']} KDA + {m['mla_layers']} MLA; KDA {m['kda_heads']}"
        f" heads x {m['kda_head_dim']}; MLA latent {m['mla_latent_dim']}; {m['experts']} experts (top-{m['top_k']},"
        f" {m['shared_experts']} shared)",
        f"layout: {_replicas(lay)}TP{lay['tensor_parallel_size']} = {lay['ranks']} rank{'s' * (lay['ranks'] > 1)},"
        f" DCP{dcp} within;"
        f" expert parallel "
        f"{'on' if lay['expert_parallel'] else 'off'}; KV cache {lay['kv_cache_dtype']}, KDA state "
        f"{lay['kv_state_dtype']} (conv tail {lay['conv_state_dtype']}); MLA page {lay['page_size']} tokens",
        "",
        f"{'weights':<22}{'per rank':>14}{'whole model':>14}  sharding",
    ]
    for group, label in _LABELS.items():
        w = p["weights"][group]
        if group == "vision" and not w["total"]:
            continue
        lines.append(f"  {label:<20}{_size(w['per_rank']):>14}{_size(w['total']):>14}  {_sharding(group, p)}")
    w = p["weights"]["total"]
    lines += [
        f"  {'total':<20}{_size(w['per_rank']):>14}{_size(w['total']):>14}",
        "",
        f"MLA latent KV: {p['mla_bytes_per_token']:,} B per token per rank ({m['mla_layers']} layers x "
        f"{m['mla_latent_dim']} x {lay['kv_cache_dtype']}, positions split DCP{dcp})",
        f"KDA state: {_size(kda['bytes'])} per request per rank ({m['kda_layers']} layers, "
        f"{kda['heads_per_rank']} of {m['kda_heads']} heads per rank)",
    ]
    if dcp > 1:
        lines.append(
            f"  DCP{dcp} splits MLA positions only: the DCP group's ranks already hold different KDA heads"
            " (raise TP to shrink the KDA state per rank)"
        )
    if p["encoder_cache"]["bytes"]:
        lines.append(f"encoder cache: {_size(p['encoder_cache']['bytes'])} of image rows at most, on rank 0")
    lines += _a2a_lines(p.get("all_to_all")) + _memory_lines(p) + _tier_lines(p.get("tiers") or {})
    head = f"{'tokens':>11}{'MLA per rank':>15}{'+ KDA state':>15}"
    mem = p["memory"]
    head += "" if mem is None else f"{'running':>10}{'pages hold':>12}"
    lines += ["", "per request" + ("" if mem is None else " and requests the pools take at once") + ":", head]
    for row in p["fits"]:
        line = f"{row['tokens']:>11,}{_size(row['mla_bytes']):>15}{_size(row['request_bytes']):>15}"
        if mem is not None:
            line += f"{row['requests']:>10,}{row['pages_hold']:>12,}"
        lines.append(line)
    return "\n".join(lines)


def _replicas(lay: dict) -> str:
    dp = lay.get("data_parallel_size", 1)
    return "" if dp == 1 else f"DP{dp} x "


def _a2a_lines(a: dict | None) -> list[str]:
    """Wide EP: the all-to-all bytes each rank sends per step (`plan_ep`)."""
    if not a:
        return []
    return [
        f"all-to-all (wide EP over {a['ranks']} ranks): {_size(a['bytes_per_token_per_layer'])} per token per MoE"
        f" layer (rows of {a['row_bytes']:,} B, dispatch + combine), {a['remote_fraction']:.0%} of it off-rank under"
        f" uniform routing, + {_size(a['counts_bytes_per_layer'])} of counts; sent per rank over"
        f" {a['moe_layers']} MoE layers:",
        f"  decode step ({a['decode_step']['tokens']:,} tokens a replica): {_size(a['decode_step']['bytes'])};"
        f" prefill step ({a['prefill_step']['tokens']:,} tokens): {_size(a['prefill_step']['bytes'])}",
        *_tp_lines(a),
    ]


def _tp_lines(a: dict) -> list[str]:
    """Wide EP with TP > 1: each TP rank's share of the tokens and its all-gather of routed rows."""
    tp = a.get("tensor_parallel_size", 1)
    if tp == 1:
        return []
    d, p = a["decode_step"], a["prefill_step"]
    return [
        f"  TP{tp} inside a replica: each rank dispatches ceil(tokens / {tp}) ({d['tokens_per_rank']:,} decode,"
        f" {p['tokens_per_rank']:,} prefill), then all-gathers the routed rows in the replica: sends"
        f" {_size(d['tp_gather_bytes'])} a decode step, {_size(p['tp_gather_bytes'])} a prefill step",
    ]


def _memory_lines(p: dict) -> list[str]:
    """The budget arithmetic, the pools the engine builds from it and the flags that build them."""
    mem, cache, lines = p["memory"], p["cache"], [""]
    if mem is not None:
        tail = f"KV budget {_size(mem['pool'])}" if mem["pool"] > 0 else f"short by {_size(-mem['pool'])}"
        enc = f" - encoder cache {_size(mem['encoder_cache'])}" if mem["encoder_cache"] else ""
        lines.append(
            f"memory per rank {_size(mem['per_rank'])} - reserve {_size(mem['reserve'])} "
            f"({mem['reserve_fraction']:.0%}, activations/overhead) - weights {_size(mem['weights'])}{enc} = {tail}"
        )
    if cache is None:
        lines.append(f"nothing fits: the KV budget cannot hold one {p['layout']['max_model_len']:,}-token request")
        return lines
    why = "as --kv-cache-memory" if cache["kv_cache_memory"] is not None else "default: what the sequences can use"
    ckpt = (
        f" + {cache['checkpoint_slots']} checkpoint slots (prefix cache, {cache['checkpoint_fraction']:.0%})"
        if cache["prefix_caching"]
        else " (prefix caching off)"
    )
    lines += [
        f"KV pools {_size(cache['bytes'])} ({why}): {cache['mla_pages']:,} MLA pages = {cache['token_capacity']:,}"
        f" tokens, {cache['live_slots']} live KDA slots{ckpt}, {_size(cache['slot_bytes'])} each",
        f"rank 0 total: {_size(p['total_per_rank'])} (weights + encoder cache + KV pools)",
        f"engine flags: {p['engine_flags']}",
    ]
    return lines


def tiers(p: dict, host: int | None, disk: int | None, unit: int) -> dict:
    """What `--kv-offload-memory` / `--kv-disk-size` hold: a tier object is one KDA state plus the
    MLA rows since the previous object (at least one match unit of `unit` tokens)."""
    state, row = p["kda_state_per_request"]["bytes"], p["mla_bytes_per_token"]
    out = {}
    for name, size in (("host", host), ("disk", disk)):
        if size:
            out[name] = {"bytes": size, "checkpoints": size // (state + unit * row), "mla_tokens": size // row}
    return out


def _tier_lines(t: dict) -> list[str]:
    return [
        f"{name} tier {_size(v['bytes'])}: at most {v['checkpoints']:,} checkpoints (a KDA state + one match unit"
        f" of MLA rows each), or {v['mla_tokens']:,} tokens of MLA rows"
        for name, v in t.items()
    ]


def add_parser(sub, defaults: EngineSettings | None = None) -> None:
    d = defaults or EngineSettings()
    p = sub.add_parser("plan", help="memory per rank for a parallel layout, from config.json alone")
    p.set_defaults(engine_defaults=d)
    p.add_argument("model", help="checkpoint directory or a config.json file (no weights needed)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument(
        "--decode-context-parallel-size",
        "-dcp",
        type=int,
        default=1,
        help="of the TP ranks, how many split MLA KV by position (divides TP)",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="routed experts split by expert over the TP ranks (with --data-parallel-size: over every replica)",
    )
    p.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1, help="engine replicas (own caches and TP ranks each)"
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="default (or 0): the config's max_position_embeddings"
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(MODEL_DTYPES), help="the engine's --dtype")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_DTYPES),
        help="the engine keeps the KV cache in --dtype; fp8 is refused (not implemented)",
    )
    p.add_argument("--kv-state-dtype", default="float32", choices=sorted(STATE_DTYPES))
    p.add_argument("--page-size", type=int, default=16, help="MLA page size in tokens")
    p.add_argument("--memory-per-rank", type=_bytes_arg, default=None, help="e.g. 141GiB, 288GB or bytes")
    p.add_argument(
        "--reserve-fraction", type=float, default=0.1, help="share of memory per rank kept for activations and overhead"
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="live KDA slots (the engine's flag)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens of a prefill step (sizes the wide-EP all-to-all)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="KDA checkpoint slots (--checkpoint-fraction of the KV budget) beside the live pools",
    )
    p.add_argument("--checkpoint-fraction", type=float, default=d.checkpoint_fraction)
    p.add_argument(
        "--encoder-cache-memory",
        type=int,
        default=d.encoder_cache_memory,
        help="bytes of image rows rank 0 keeps (models with a vision tower)",
    )
    p.add_argument("--kv-offload-memory", type=_bytes_arg, default=None, help="host tier size, e.g. 64GiB")
    p.add_argument("--kv-disk-size", type=_bytes_arg, default=None, help="disk tier size, e.g. 1TiB")
    p.add_argument("--prefix-match-unit", type=int, default=64, help="tokens per match unit (a tier object's least)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    lay = Layout(
        args.tensor_parallel_size,
        args.decode_context_parallel_size,
        args.enable_expert_parallel,
        args.kv_cache_dtype,
        args.kv_state_dtype,
        args.page_size,
        args.dtype,
        args.data_parallel_size,
    )
    eng = EngineSettings(
        args.max_num_seqs,
        args.enable_prefix_caching,
        args.checkpoint_fraction,
        args.encoder_cache_memory,
        args.max_num_batched_tokens,
    )
    try:
        cfg, vision = load_config(args.model), load_vision_config(args.model)
        p = plan(
            cfg, lay, args.memory_per_rank, args.max_model_len, args.reserve_fraction, vision, eng, args.engine_defaults
        )
    except (ConfigError, PlanError) as e:
        print(f"deltaserve plan: error: {e}", file=sys.stderr)
        return 2
    t = tiers(p, args.kv_offload_memory, args.kv_disk_size, args.prefix_match_unit)
    if t:
        p["tiers"] = t
    print(json.dumps(p) if args.json else render(p))
    return 0
