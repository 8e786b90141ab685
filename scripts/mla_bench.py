"""MLA attention kernel bench at K3's geometry, each figure beside the rooflines measured on the same
device (`kda_bench.rooflines`: HBM copy bandwidth, bf16 matmul throughput):

- prefill of one fresh sequence of T tokens (unabsorbed, causal): ours (`kernels.triton.mla_prefill`),
  torch's FlashAttention varlen kernel (`kernels.extern.flash_prefill`, where it fits) and the padded
  SDPA path (`TorchOps.mla_prefill`, what the reference backend runs);
- extend: a chunk of C queries after a cached prefix (context T in pages of 16), absorbed: ours
  through the block table against the reference's gather + SDPA (`ops.mla.mla_absorbed_attention`),
  and the same attention unabsorbed (the gathered rows decompressed by a kv_b of the same geometry,
  then `TorchOps.mla_context_prefill`: what the CPU engine runs for prefill chunks; its TFLOP/s
  counts the absorbed form's FLOPs, so the extend rows compare as times).

FLOPs count the visible (causal) query-key pairs: prefill H T^2 / 2 pairs x 2 (Dqk + Dv), extend
H C (T + C / 2) pairs x 2 (2 R + Dr). Bytes: q, k, v, o once (prefill); the context's rows, q and
o once (extend).

    python scripts/mla_bench.py --device cuda --lengths 4096,8192,16384,32768
"""

from __future__ import annotations

import argparse

import torch
from kda_bench import _timer, report, rooflines

from deltaserve.ops import mla as mla_ops
from deltaserve.ops.backends.torch import REFERENCE


def prefill_candidates(device: torch.device) -> dict:
    from deltaserve.kernels.extern import flash_prefill
    from deltaserve.kernels.triton.mla_prefill import mla_prefill_attention

    out = {"ours": mla_prefill_attention, "sdpa": REFERENCE.mla_prefill}
    if device.type == "cuda" and flash_prefill.available():
        out["torch-flash"] = flash_prefill.prefill
    return out


def prefill_case(t: int, a, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(t, a.heads, a.nope + a.rope, device=device, dtype=dtype, generator=g)
    kv = torch.randn(t, a.heads, a.nope + a.v_dim, device=device, dtype=dtype, generator=g)
    k_rot = torch.randn(t, a.rope, device=device, dtype=dtype, generator=g)
    cu = torch.tensor([0, t], device=device)
    return (q, kv[..., : a.nope], k_rot, kv[..., a.nope :], cu, (a.nope + a.rope) ** -0.5)


def extend_case(t: int, a, dtype, device):
    """A chunk of a.chunk queries after t cached positions, pages of 16 in a shuffled pool."""
    page, ctx = 16, t + a.chunk
    pages = -(-ctx // page)
    g = torch.Generator(device=device).manual_seed(1)
    rows = torch.randn(pages * page, a.rank + a.rope, device=device, dtype=dtype, generator=g)
    table = torch.randperm(pages, device=device, generator=g).view(1, pages)
    pos = torch.arange(ctx, device=device)
    read_rows = table[0, pos // page] * page + pos % page
    q = torch.randn(a.chunk, a.heads, a.rank + a.rope, device=device, dtype=dtype, generator=g)
    cu_q, cu_kv = torch.tensor([0, a.chunk], device=device), torch.tensor([0, ctx], device=device)
    return q, rows, table, read_rows, cu_q, cu_kv


def unabsorbed_operands(a, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's queries in the unabsorbed form [C, H, nope + rope] and a kv_b [H (nope + v), R]."""
    g = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(a.chunk, a.heads, a.nope + a.rope, device=device, dtype=dtype, generator=g)
    w = torch.randn(a.heads * (a.nope + a.v_dim), a.rank, device=device, dtype=dtype, generator=g) * a.rank**-0.5
    return q, w


def _row(kind, t, name, sec, flops, nbytes, roof) -> dict:
    t_bw, t_tc = nbytes / (roof["hbm_gb_s"] * 1e9), flops / (roof["bf16_tflops"] * 1e12)
    return {
        "kind": kind, "T": t, "impl": name, "ms": sec * 1e3, "tflops": flops / sec / 1e12,
        "of_tc_roofline": t_tc / sec, "of_hbm_roofline": t_bw / sec,
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--lengths", default="4096,8192,16384,32768")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--nope", type=int, default=128)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--rank", type=int, default=512)
    p.add_argument("--chunk", type=int, default=2048, help="extend: queries after the cached prefix")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bandwidth-mib", type=int, default=2048)
    p.add_argument("--gemm", type=int, default=8192)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    roof = rooflines(device, a.bandwidth_mib, a.gemm, a.reps)
    print(f"rooflines on {device}: HBM {roof['hbm_gb_s']:.0f} GB/s, bf16 matmul {roof['bf16_tflops']:.1f} TFLOP/s")
    from deltaserve.kernels.triton.mla_prefill import mla_extend_attention

    size = torch.finfo(dtype).bits // 8
    with torch.inference_mode():
        for t in (int(x) for x in a.lengths.split(",")):
            rows = []
            case = prefill_case(t, a, dtype, device)
            flops = a.heads * t * t * (a.nope + a.rope + a.v_dim)
            nbytes = size * t * a.heads * (2 * (a.nope + a.rope) + 2 * a.v_dim)
            for name, fn in prefill_candidates(device).items():
                sec = _timer(device, lambda: fn(*case), a.reps)
                rows.append(_row("prefill", t, name, sec, flops, nbytes, roof))
            q, pool, table, read_rows, cu_q, cu_kv = extend_case(t, a, dtype, device)
            scale = (a.nope + a.rope) ** -0.5
            flops = 2 * a.heads * a.chunk * (t + a.chunk / 2) * (2 * a.rank + a.rope)
            nbytes = size * ((t + a.chunk) * (a.rank + a.rope) + a.chunk * a.heads * (2 * a.rank + a.rope))
            q_plain, w_kvb = unabsorbed_operands(a, dtype, device)

            def unabsorbed():
                r = pool[read_rows]
                kv = (r[:, : a.rank] @ w_kvb.T).view(-1, a.heads, a.nope + a.v_dim)
                k_nope, v = kv[..., : a.nope], kv[..., a.nope :]
                return REFERENCE.mla_context_prefill(q_plain, k_nope, r[:, a.rank :], v, cu_q, cu_kv, scale)

            ext = {
                "ours": lambda: mla_extend_attention(q, pool, table, 16, cu_q, cu_kv, a.rank, scale),
                "gather+sdpa": lambda: mla_ops.mla_absorbed_attention(q, pool[read_rows], cu_q, cu_kv, a.rank, scale),
                "unabsorbed": unabsorbed,
            }
            for name, fn in ext.items():
                rows.append(_row("extend", t, name, _timer(device, fn, a.reps), flops, nbytes, roof))
            for r in rows:
                report(f"{r['kind']:7s} T={t:6d} H={a.heads} {r['impl']:12s}", r, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
