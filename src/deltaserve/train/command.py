"""`deltaserve train-tiny OUT`: argument parsing and the run (the trainer is `trainer.Trainer`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..tiny import FAMILIES


def add_parser(sub) -> None:
    from .trainer import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train-tiny",
        help="train a small model of either family on the synthetic chat curriculum (CPU, resumable)",
    )
    p.add_argument("out", type=Path, help="output directory: work/ (state, resumable) and model/ (the checkpoint)")
    p.add_argument("--family", choices=FAMILIES, default=d.family)
    p.add_argument("--preset", default=d.preset, help="model size (tiny.PRESETS; default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument(
        "--qat-from", type=float, default=d.qat_from, help="fraction of steps after which experts train through MXFP4"
    )
    p.add_argument("--thinking-share", type=float, default=d.thinking_share)
    p.add_argument("--recall-max", type=int, default=d.recall_max)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from .trainer import TrainConfig, Trainer

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    trainer = Trainer(cfg, args.out)
    out = trainer.run(progress=not args.no_progress)
    record = json.loads((out / "training.json").read_text())
    print(json.dumps({"model": str(out), **{k: record[k] for k in ("steps", "train_seconds", "final_loss")}}))
    return 0
