"""`deltaserve` command line: one argparse subcommand per `_add_<name>` builder, each setting
`func(args) -> int` (the exit status). Heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _make_tiny(args: argparse.Namespace) -> int:
    import torch

    from .tiny import PRESETS, make_tiny, param_count

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    out = make_tiny(
        args.out,
        family=args.family,
        preset=args.preset,
        mxfp4=args.mxfp4,
        seed=args.seed,
        dtype=dtype,
        vision=args.vision,
        tokenizer_ranks=args.tokenizer_ranks,
    )
    mxfp4 = PRESETS[(args.family, args.preset)].mxfp4 if args.mxfp4 is None else args.mxfp4
    print(
        f"wrote {args.family} {args.preset} checkpoint ({param_count(args.family, args.preset):,} params,"
        f" experts {'MXFP4' if mxfp4 else args.dtype}, seed {args.seed}) to {out}:"
    )
    for f in sorted(Path(out).iterdir()):
        print(f"  {f.name:40s} {f.stat().st_size:>14,} B")
    return 0


def _add_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a random-weight checkpoint in the real HF layout")
    p.add_argument("--family", required=True, choices=["kimi_k3", "kimi_linear"])
    p.add_argument("--out", required=True, type=Path, help="output directory (created if absent)")
    p.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "small", "mini"],
        help="tiny: tests (~1M params); small: the size train-tiny trains (~4M); mini: benchmarks (~1B params)",
    )
    p.add_argument(
        "--mxfp4",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="store routed experts MXFP4-packed (default: the preset's, mini K3 on)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the non-fp32 tensors")
    p.add_argument(
        "--vision",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="K3's vision tower, vision_config and preprocessor_config.json (default: on for kimi_k3)",
    )
    p.add_argument(
        "--tokenizer-ranks",
        type=Path,
        default=None,
        help="tiktoken base-rank file (e.g. Moonshot's Kimi ranks) instead of cl100k_base's first ranks; "
        "the vocabulary grows to its size + 256, so prompt token counts equal the real model's",
    )
    p.set_defaults(func=_make_tiny)


def _generate(args: argparse.Namespace) -> int:
    import logging

    from .engine.config import EngineConfig
    from .engine.llm import LLM
    from .engine.request.sampling_params import SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    with LLM.from_config(EngineConfig.from_args(args, data_parallel_size=args.data_parallel_size)) as llm:
        for out in llm.generate(args.prompt, params):
            print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
        print(llm.stats())
    return 0


def _add_generate(sub) -> None:
    from .engine.config import add_engine_args

    p = sub.add_parser("generate", help="run prompts through the offline engine and print the outputs")
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas (processes) the prompts are spread over, each with its own caches "
        "and tensor-parallel ranks; prompts sharing a prefix go to the same one",
    )
    p.set_defaults(func=_generate)


def _add_bench(sub) -> None:
    from .bench import kda_scaling, latency, pd, prefix, roofline, spec, throughput, vs_reference

    p = sub.add_parser("bench", help="benchmarks (each prints measured figures beside a baseline)")
    kinds = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for mod in (prefix, roofline, latency, throughput, kda_scaling, vs_reference, pd, spec):
        mod.add_parser(kinds)


def plan_defaults():
    """`deltaserve plan`'s engine flags default to the engine's own (`EngineConfig`)."""
    import dataclasses

    from .cache.plan_engine import EngineSettings
    from .engine.config import EngineConfig

    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    return EngineSettings(**{f.name: fields[f.name] for f in dataclasses.fields(EngineSettings)})


def _add_plan(sub) -> None:
    from .cache import plan_report

    plan_report.add_parser(sub, plan_defaults())


def _serve(args: argparse.Namespace) -> int:
    from .serve import serve

    return serve(args)


def _add_serve(sub) -> None:
    from .serve import add_arguments

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the embedded tiny model)")
    add_arguments(p)
    p.set_defaults(func=_serve)


def _proxy(args: argparse.Namespace) -> int:
    from .proxy import run_proxy

    return run_proxy(args)


def _add_proxy(sub) -> None:
    from .proxy import add_proxy_arguments

    p = sub.add_parser("proxy", help="OpenAI-compatible front of prefill and decode instances (serve --role)")
    add_proxy_arguments(p)
    p.set_defaults(func=_proxy)


def _env(args: argparse.Namespace) -> int:
    from .env import listing

    print(listing())
    return 0


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="the DELTASERVE_* environment variables: kind, default, meaning, value if set")
    p.set_defaults(func=_env)


def _add_train(sub) -> None:
    from .train import command

    command.add_parser(sub)


def _add_eval(sub) -> None:
    from .evals import command

    command.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltaserve", description="deltaserve: a serving engine for Kimi K3 / Kimi-Linear"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        _add_make_tiny,
        _add_generate,
        _add_bench,
        _add_plan,
        _add_serve,
        _add_proxy,
        _add_env,
        _add_train,
        _add_eval,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
