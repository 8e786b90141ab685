"""KDA prefill kernel bench: ours (`kernels.triton.kda.chunk_kda`, with and without state exports)
against fla-core's `chunk_kda` (where it imports) and the PyTorch path, one sequence of T tokens,
each figure beside the rooflines this script measures on the same device:

- HBM bandwidth: best `y.copy_(x)` over a large tensor, read + write bytes;
- tensor-core (matmul) throughput: best square bf16 and tf32 `torch.matmul`.

The op's roofline time is max(bytes / bandwidth, FLOPs / matmul peak), with bytes = the packed
fp32 inputs and output plus the final state, and FLOPs = the chunked form's matmuls
(intra-chunk A_kk and A_qk, W and U, and per chunk W S, Qg S, A delta, Kd^T delta). Prints one
line per figure; `--json` adds one JSON object per line.

    python scripts/kda_bench.py --device cuda --lengths 4096,8192,16384,32768
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deltaserve.ops import kda as kda_ops


def _timer(device: torch.device, fn, reps: int) -> float:
    """Best-of-`reps` seconds of fn() after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def rooflines(device: torch.device, mib: int, gemm: int, reps: int) -> dict:
    x = torch.empty(mib * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / _timer(device, lambda: y.copy_(x), reps) / 1e9
    out = {"hbm_gb_s": bw}
    for name, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
        a = torch.randn(gemm, gemm, device=device, dtype=dtype)
        torch.backends.cuda.matmul.allow_tf32 = True
        out[f"{name}_tflops"] = 2 * gemm**3 / _timer(device, lambda: a @ a, reps) / 1e12
        torch.backends.cuda.matmul.allow_tf32 = False
    return out


def report(label: str, row: dict, as_json: bool) -> None:
    """One figure's line (time, TFLOP/s, its share of each roofline), then its JSON when asked."""
    print(
        f"{label} {row['ms']:9.3f} ms  {row['tflops']:7.2f} TFLOP/s ({100 * row['of_tc_roofline']:5.1f}% of bf16 TC, "
        f"{100 * row['of_hbm_roofline']:5.1f}% of HBM)"
    )
    if as_json:
        print(json.dumps(row))


def kda_cost(t: int, h: int, dk: int, dv: int, chunk: int = 64) -> tuple[float, float]:
    """(FLOPs, bytes) of one chunked KDA prefill of t tokens (see the module docstring)."""
    flops = t * h * (2 * 2 * chunk * dk + 2 * chunk * (dk + dv) + 2 * 3 * dk * dv + 2 * chunk * dv)
    nbytes = 4 * (t * h * (3 * dk + 2 * dv + 1) + 2 * h * dk * dv)
    return float(flops), float(nbytes)


def inputs(t: int, h: int, dk: int, dv: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    q = kda_ops.l2_norm(torch.randn(t, h, dk, device=device, generator=gen))
    k = kda_ops.l2_norm(torch.randn(t, h, dk, device=device, generator=gen))
    v = torch.randn(t, h, dv, device=device, generator=gen)
    g = -torch.rand(t, h, dk, device=device, generator=gen)
    beta = torch.rand(t, h, device=device, generator=gen)
    return q, k, v, g, beta, torch.tensor([0, t], device=device)


def candidates(args, device: torch.device) -> dict:
    from deltaserve.kernels.extern import fla_kda
    from deltaserve.kernels.triton.kda import chunk_kda

    prec = "ieee" if device.type == "cpu" else "tf32"
    out = {
        "ours": lambda a: chunk_kda(*a, scale=args.head_dim**-0.5, precision=prec),
        "ours+exports": lambda a: chunk_kda(
            *a,
            scale=args.head_dim**-0.5,
            precision=prec,
            export_offsets=[list(range(args.export_every, a[0].shape[0] + 1, args.export_every))],
        ),
    }
    if device.type == "cuda" and fla_kda.available():
        out["fla"] = lambda a: fla_kda.chunk_kda(*a, scale=args.head_dim**-0.5)
    if args.torch:
        out["torch"] = lambda a: kda_ops.kda_chunked(*a, scale=args.head_dim**-0.5)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="4096,8192,16384,32768")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bandwidth-mib", type=int, default=2048)
    p.add_argument("--gemm", type=int, default=8192)
    p.add_argument("--export-every", type=int, default=1024, help="export offsets of `ours+exports`")
    p.add_argument("--torch", action="store_true", help="also time the PyTorch path")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    device = torch.device(args.device)
    roof = rooflines(device, args.bandwidth_mib, args.gemm, args.reps)
    print(
        f"rooflines on {device}: HBM {roof['hbm_gb_s']:.0f} GB/s, bf16 matmul {roof['bf16_tflops']:.1f} TFLOP/s, "
        f"tf32 matmul {roof['tf32_tflops']:.1f} TFLOP/s"
    )
    with torch.inference_mode():
        for t in (int(x) for x in args.lengths.split(",")):
            a = inputs(t, args.heads, args.head_dim, args.head_dim, device)
            flops, nbytes = kda_cost(t, args.heads, args.head_dim, args.head_dim)
            t_bw, t_tc = nbytes / (roof["hbm_gb_s"] * 1e9), flops / (roof["bf16_tflops"] * 1e12)
            for name, fn in candidates(args, device).items():
                sec = _timer(device, lambda: fn(a), args.reps)
                row = {
                    "T": t, "impl": name, "ms": sec * 1e3, "tflops": flops / sec / 1e12, "gb_s": nbytes / sec / 1e9,
                    "roofline_ms": max(t_bw, t_tc) * 1e3, "of_hbm_roofline": t_bw / sec, "of_tc_roofline": t_tc / sec,
                }  # fmt: skip
                report(f"T={t:6d} H={args.heads} d={args.head_dim} {name:13s}", row, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
