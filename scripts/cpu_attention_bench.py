"""CPU MLA prefill attention bench: the native flash kernel (`NativeKernels.flash_attention`, what
`CpuNativeOps` runs for bf16) against the PyTorch SDPA path it replaced (`ops.mla`), one sequence,
in both forms, each figure beside the useful GFLOP/s it reaches:

- unabsorbed (`mla_context_attention`): n queries over c rows, keys nope + rope, values v, H heads;
  useful FLOPs 2 x pairs x H x (nope + rope + v), pairs = the causal (query, row) pairs;
- absorbed (`mla_absorbed_attention`): n queries x H heads over c latent rows (rank + rope wide,
  values their first rank columns); useful FLOPs 2 x n x c x H x (2 rank + rope).

Best of `--reps` after a warm-up, both sides in one process (this host's bandwidth and clocks move
between runs). Prints one line per shape; `--json` prints JSON objects instead.

    python scripts/cpu_attention_bench.py --shapes 2048x2048,2048x8192 --absorbed 16x8192,160x8192
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deltaserve.kernels.cpu import library
from deltaserve.ops import mla


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def unabsorbed(k, n: int, c: int, args) -> dict:
    h, nope, rope, dv = args.heads, args.nope, args.rope, args.v
    q = torch.randn(n, h, nope + rope).bfloat16()
    kv = torch.randn(c, h, nope + dv).bfloat16()
    k_nope, v, k_rot = kv[..., :nope], kv[..., nope:], torch.randn(c, rope).bfloat16()
    cu_q, cu_kv, scale = torch.tensor([0, n]), torch.tensor([0, c]), (nope + rope) ** -0.5
    keys, vals = mla.joined_keys(k_nope, k_rot), v.contiguous()
    sdpa = _best(lambda: mla.mla_context_attention(q, keys, vals, cu_q, cu_kv, scale), args.reps)
    ours = _best(lambda: k.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, scale), args.reps)
    pairs = n * (c - n) + n * (n + 1) / 2
    return _row("unabsorbed", n, c, 2 * pairs * h * (nope + rope + dv), sdpa, ours)


def absorbed(k, n: int, c: int, args) -> dict:
    h, rank, rope = args.heads, args.rank, args.rope
    q = torch.randn(n, h, rank + rope).bfloat16()
    rows = torch.randn(c, rank + rope).bfloat16()
    cu_q, cu_kv, scale = torch.tensor([0, n]), torch.tensor([0, c]), (rank + rope) ** -0.5
    latent = rows[:, None, :rank]
    sdpa = _best(lambda: mla.mla_absorbed_attention(q, rows, cu_q, cu_kv, rank, scale), args.reps)
    ours = _best(
        lambda: k.flash_attention(q.view(n * h, 1, -1), latent, rows[:, rank:], latent, cu_q, cu_kv, scale, h),
        args.reps,
    )
    return _row("absorbed", n, c, 2 * n * c * h * (2 * rank + rope), sdpa, ours)


def _row(form: str, n: int, c: int, flops: float, sdpa: float, ours: float) -> dict:
    return {
        "form": form,
        "queries": n,
        "rows": c,
        "sdpa_ms": sdpa * 1e3,
        "ours_ms": ours * 1e3,
        "sdpa_gflops": flops / sdpa / 1e9,
        "ours_gflops": flops / ours / 1e9,
        "speedup": sdpa / ours,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="2048x2048,2048x4096,2048x8192", help="unabsorbed: queriesxrows,...")
    p.add_argument("--absorbed", default="16x8192,64x8192,160x8192", help="absorbed: queriesxrows,...")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--v", type=int, default=128)
    p.add_argument("--rank", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    k = library.native()
    if k is None or not k.avx512_bf16:
        print("the native kernels with AVX512-BF16 are not available here: nothing to compare")
        return 1
    torch.manual_seed(0)
    rows = [unabsorbed(k, n, c, args) for n, c in _shapes(args.shapes)]
    rows += [absorbed(k, n, c, args) for n, c in _shapes(args.absorbed)]
    for r in rows:
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['form']:10s} {r['queries']:5d} x {r['rows']:6d}: SDPA {r['sdpa_ms']:8.1f} ms "
                f"({r['sdpa_gflops']:5.0f} GFLOP/s)  ours {r['ours_ms']:8.1f} ms ({r['ours_gflops']:5.0f})  "
                f"x{r['speedup']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
