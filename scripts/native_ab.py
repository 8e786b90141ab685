"""Two builds of the native CPU kernels side by side in one process: this tree's sources against a git
revision's, each driving its own engine on the same checkpoint, rounds alternating. This host's memory
bandwidth moves between regimes within minutes, so only interleaved measurements compare two builds.

    python scripts/native_ab.py --model DIR --base HEAD~1 --mode decode --seqs 32 --prompt-len 64
    python scripts/native_ab.py --model DIR --base c7674f3 --mode prefill --prompt-len 2048

`decode`: the median of each round's decode steps (every step timed by itself, after the prompts'
prefill), `--seqs` sequences together; `prefill`: one prompt's time to first token, prefix caching off.
Without `--base` both engines run this tree's build (the spread of a measurement against itself).
Both builds are bound through this tree's `ds_abi.h`: a revision of another DS_ABI_VERSION is refused.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.kernels.cpu import library
from deltaserve.kernels.cpu.abi import AbiMismatch
from deltaserve.kernels.cpu.build import CSRC

ROOT = Path(__file__).resolve().parents[1]


def revision_sources(rev: str, into: Path) -> Path:
    """The kernel sources (`csrc/`) of git revision `rev`, written under `into`."""
    rel = CSRC.relative_to(ROOT).as_posix()
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, rel], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / rel


def engine(model: str, kernels, args) -> LLM:
    with library.using(kernels):
        return LLM(
            model,
            dtype="bfloat16",
            max_num_seqs=max(args.seqs, 1),
            max_model_len=args.prompt_len + args.output_len + 16,
            enable_prefix_caching=args.mode == "decode",
            progress=False,
        )


def one_round(llm: LLM, kernels, prompts: list[list[int]], args, tag: str) -> float:
    """Milliseconds: the median decode step, or the time to first token."""
    core = llm.engine
    params = SamplingParams(max_tokens=args.output_len if args.mode == "decode" else 1, temperature=0, ignore_eos=True)
    with library.using(kernels):
        for i, p in enumerate(prompts):
            core.add_request(f"{tag}-{i}", p, params)
        steps = []
        while core.has_unfinished():
            start = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - start)
    if args.mode == "prefill":
        return sum(steps) * 1e3
    decode = steps[-(args.output_len - 1) :]  # the prompts' prefill steps come first
    return statistics.median(decode) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--base", help="git revision of the other build (default: this tree's again)")
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--seqs", type=int, default=1, help="sequences decoding together (decode)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=33)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    if args.mode == "decode" and args.output_len < 2:
        ap.error("--output-len must be at least 2 in decode mode")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            base = library.load(csrc=revision_sources(args.base, Path(tmp))) if args.base else library.load()
        except AbiMismatch as e:
            sys.exit(
                f"{args.base}'s kernels have another ABI than this tree's ds_abi.h; compare revisions of one ABI ({e})"
            )
        builds = {f"base ({args.base or 'this tree'})": base, "this tree": library.load()}
        engines = {name: engine(args.model, k, args) for name, k in builds.items()}
        gen = torch.Generator().manual_seed(0)
        vocab = next(iter(engines.values())).model.config.vocab_size
        prompts = [torch.randint(100, vocab - 1, (args.prompt_len,), generator=gen).tolist() for _ in range(args.seqs)]
        for name, llm in engines.items():  # warm-up: first-touch of pools and caches
            one_round(llm, builds[name], prompts, args, f"warm-{name}")
        times = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, llm in engines.items():
                times[name].append(one_round(llm, builds[name], prompts, args, f"{r}-{name}"))
    what = "decode step" if args.mode == "decode" else "time to first token"
    for name, t in times.items():
        print(f"{name}: median {what} {statistics.median(t):.2f} ms  ({', '.join(f'{x:.1f}' for x in t)})")
    (b, bt), (_, nt) = times.items()
    ratios = sorted(x / y for x, y in zip(bt, nt))
    spread = f"min {ratios[0]:.3f}, max {ratios[-1]:.3f}"
    print(f"{b} / this tree, per round: median {statistics.median(ratios):.3f} ({spread})")


if __name__ == "__main__":
    sys.exit(main())
