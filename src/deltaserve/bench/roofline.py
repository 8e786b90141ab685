"""`deltaserve bench roofline`: this machine's limits at the chosen thread count.

- streaming read bandwidth: best-of-`reps` wall time of `x.sum()` over an fp32 tensor of
  `--bandwidth-mib` MiB (on CPU in huge pages, as the weights are), both with torch's own
  intra-op threads and split into one slice per thread summed from Python threads (torch
  releases the GIL); `bandwidth_gb_s` is the better;
- copy bandwidth: `y.copy_(x)`, counted as read + write bytes (reported, not used as the limit);
- GEMM: best-of-`reps` `torch.matmul` of square n×n at each `--gemm-sizes` n, 2n³ FLOPs, per
  dtype (bf16, fp32); the headline per dtype is the best size.

GB and GFLOP are 1e9. Use a tensor far larger than the last-level cache for a DRAM figure
(tests use small sizes, which then measure cache bandwidth). With `--device cuda` every figure is
the GPU's (HBM bandwidth, tensor-core GEMMs), each timing waiting for the device; there is no
Python-thread split there.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

from .common import add_common, apply_threads, best_time, emit, int_list, meta

DTYPES = ("bfloat16", "float32")


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the streamed tensor")
    p.add_argument("--gemm-sizes", type=int_list, default=[1024, 2048], help="square GEMM sizes")
    p.add_argument("--roofline-reps", type=int, default=5, help="best-of repetitions")


def bench_device(args: argparse.Namespace):
    """The device the run's figures are for (`--device`, `auto` resolved)."""
    import torch

    from ..engine.core.builder import resolve_device

    return torch.device(resolve_device(getattr(args, "device", None) or "cpu"))


def _waited(fn, device):
    """`fn`, then a wait for `device` (CUDA work is asynchronous); `fn` itself elsewhere."""
    import torch

    if device.type != "cuda":
        return fn

    def run():
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return run


def stream_tensor(mib: int, device="cpu"):
    """The fp32 tensor (ones) the bandwidth is read over; on CPU in huge pages where the weights
    are (`model.huge_pages`: the limit is what the weights' own pages allow)."""
    import torch

    from ..model.huge_pages import huge_page_bytes, huge_pages_enabled

    n = max(1, mib * 2**20 // 4)
    if torch.device(device).type == "cpu" and huge_pages_enabled():
        try:
            return huge_page_bytes(4 * n).view(torch.float32).fill_(1.0)
        except OSError:  # refused: the weights stayed mapped too (`place_weights`)
            pass
    return torch.ones(n, dtype=torch.float32, device=device)


def read_bandwidth(x, reps: int) -> tuple[float, float]:
    """(GB/s of `x.sum()` on torch's threads, GB/s of one slice per thread summed from Python
    threads), best of `reps` each; on CUDA the device's `x.sum()` twice."""
    import torch

    nbytes = x.numel() * x.element_size()
    if x.is_cuda:
        read = nbytes / best_time(_waited(x.sum, x.device), reps) / 1e9
        return read, read
    threads = torch.get_num_threads()
    x.sum()
    t_sum = best_time(x.sum, reps)
    parts = x.chunk(threads)
    with ThreadPoolExecutor(threads) as pool:

        def split_sum():
            return list(pool.map(lambda t: t.sum(), parts))

        split_sum()
        t_split = best_time(split_sum, reps)
    return nbytes / t_sum / 1e9, nbytes / t_split / 1e9


def measure_bandwidth(mib: int, reps: int, device="cpu") -> dict:
    import torch

    device = torch.device(device)
    x = stream_tensor(mib, device)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    read_sum, read_split = read_bandwidth(x, reps)
    y.copy_(x)
    t_copy = best_time(_waited(lambda: y.copy_(x), device), reps)
    return {
        "bandwidth_gb_s": max(read_sum, read_split),
        "read_sum_gb_s": read_sum,
        "read_split_gb_s": read_split,
        "copy_gb_s": 2 * nbytes / t_copy / 1e9,
        "bandwidth_bytes": nbytes,
    }


def measure_gemm(dtype_name: str, sizes: list[int], reps: int, device="cpu") -> dict:
    """{"gflops": best over sizes, "by_size": {n: GFLOP/s}}."""
    import torch

    dtype, device = getattr(torch, dtype_name), torch.device(device)
    by_size = {}
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype, device=device)
        torch.matmul(a, b, out=out)
        t = best_time(_waited(lambda: torch.matmul(a, b, out=out), device), reps)
        by_size[str(n)] = 2 * n**3 / t / 1e9
    return {"gflops": max(by_size.values()), "by_size": by_size}


def measure(args: argparse.Namespace) -> dict:
    """The roofline figures of `--device` (at the current torch thread count on CPU)."""
    import torch

    device = bench_device(args)
    with torch.inference_mode():
        out = measure_bandwidth(args.bandwidth_mib, args.roofline_reps, device)
        for name in DTYPES:
            g = measure_gemm(name, args.gemm_sizes, args.roofline_reps, device)
            short = "bf16" if name == "bfloat16" else "fp32"
            out[f"gemm_{short}_gflops"] = g["gflops"]
            out[f"gemm_{short}_by_size"] = g["by_size"]
    out["threads"] = torch.get_num_threads()
    out["device"] = str(device)
    return out


def gemm_gflops(roof: dict, dtype_name: str) -> float:
    return roof["gemm_bf16_gflops" if dtype_name == "bfloat16" else "gemm_fp32_gflops"]


def add_parser(sub) -> None:
    p = sub.add_parser("roofline", help="memory bandwidth and GEMM GFLOP/s of this machine")
    add_common(p)
    add_roofline_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    apply_threads(args)
    roof = measure(args)
    result = dict(roof, gemm_gflops=gemm_gflops(roof, args.dtype), meta=meta(args))
    rows = [
        {"measure": "read bandwidth (sum)", "value": roof["read_sum_gb_s"], "unit": "GB/s"},
        {"measure": "read bandwidth (split)", "value": roof["read_split_gb_s"], "unit": "GB/s"},
        {"measure": "copy bandwidth", "value": roof["copy_gb_s"], "unit": "GB/s"},
    ]
    for short in ("bf16", "fp32"):
        rows += [
            {"measure": f"{short} GEMM n={n}", "value": v, "unit": "GFLOP/s"}
            for n, v in roof[f"gemm_{short}_by_size"].items()
        ]
    return emit(args, result, rows, ["measure", "value", "unit"])
