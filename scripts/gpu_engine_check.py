"""Engine greedy equality: `TritonOps` on `--device` against the reference backend on CPU, on
tiny random checkpoints, with prefix caching off and on (the second run of a shared prefix
restores a KDA checkpoint exported inside the first prefill). fp32 token streams must be equal
(exit 1 otherwise); bf16 ones are reported as the share of equal tokens (near-ties may differ).
The reference backend itself also runs on `--device` (what `--device cuda` serves without the
`gpu` extra), fp32, cache on: its tokens must equal the CPU's too.

    python scripts/gpu_engine_check.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from deltaserve import LLM, SamplingParams
from deltaserve.tiny import make_tiny

PROMPTS = [list(range(300, 333)), list(range(300, 333)) + [7, 8, 9], list(range(900, 911))]


def run(ckpt: Path, device: str, dtype: str, triton: bool, cache: bool, max_tokens: int) -> list[list[int]]:
    os.environ["DELTASERVE_TRITON"] = "1" if triton else "0"
    llm = LLM(
        ckpt,
        dtype,
        device=device,
        max_num_seqs=2,
        page_size=4,
        max_model_len=128,
        kv_cache_memory=16 * 2**20,
        enable_prefix_caching=cache,
        prefix_match_unit=8,
        progress=False,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    llm.check_integrity()
    return outs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--families", default="kimi_k3,kimi_linear")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            ckpt = make_tiny(Path(tmp) / family, family=family, preset="tiny", seed=17)
            for dtype in args.dtypes.split(","):
                ref = run(ckpt, "cpu", dtype, False, False, args.max_tokens)
                runs = [(True, False), (True, True)] + ([(False, True)] if dtype == "float32" else [])
                for triton, cache in runs:
                    got = run(ckpt, args.device, dtype, triton, cache, args.max_tokens)
                    same = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y))
                    total = sum(len(x) for x in ref)
                    ok = got == ref
                    failures += dtype == "float32" and not ok
                    print(
                        f"engine {family} {dtype} cache={'on' if cache else 'off'}: "
                        f"{'triton' if triton else 'reference'} on {args.device} vs "
                        f"reference on cpu: {same}/{total} tokens equal{'' if ok else ' (MISMATCH)'}"
                    )
    print("engine check:", "FAILED" if failures else "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
