"""`CpuDenseOps`: the linear, norm, AttnRes, GLU and MoE families on the native CPU kernels
(`kernels.cpu`); `ops.backends.cpu.CpuNativeOps` adds the attention families.

Each method runs its kernel where the operands fit it (bf16 activations, small batches for the
GEMV kernels, tiles (AMX, or AVX512-BF16 register tiles) where the CPU has them) and otherwise the
reference (`TorchOps`); both accumulate in fp32 and round once, only the summation order differs.
"""

from __future__ import annotations

import functools

import torch

from ...kernels.cpu import ACT_SILU, ACT_SITU, AMX_ROWS, MAX_ROWS, NativeKernels
from ...kernels.cpu.blocks import MoeBlockWeights
from ..attn_res import ATTN_RES_EPS
from ..fallbacks import fallback
from ..mxfp4 import mxfp4_decode
from ..operands import ExpertWeights, GluAct, MoeWeights, PackedExpertView, RouteSpec, ServedShapes, dtype_name
from .torch import TorchOps

FUSED_MAX_TOKENS = 64  # above this many tokens, per-expert GEMMs (oneDNN) beat the fused GEMVs
ROW_BUCKET = 32  # prefill expert GEMMs run on row counts rounded up to a multiple of this


def act_spec(act: GluAct) -> tuple[int, float, float | None]:
    """(kernel activation id, beta, linear_beta) of a GLU activation."""
    return (ACT_SITU if act.kind == "situ" else ACT_SILU), act.beta or 0.0, act.linear_beta


@functools.lru_cache(maxsize=AMX_ROWS)
def _single_expert_routing(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) routing each of n tokens to expert 0 with weight 1 (read-only constants)."""
    return torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.float32)


class CpuDenseOps(TorchOps):
    """Linear, norms, AttnRes, the dense GLU MLP and the MoE families on the native kernels."""

    name = "cpu-native"

    def __init__(self, kernels: NativeKernels, fuse_blocks: bool = True):
        """`fuse_blocks=False` builds no whole-block plans (the module-by-module native path,
        which tests compare the blocks against)."""
        self.k = kernels
        self.fuse_blocks = fuse_blocks

    def describe(self, served: ServedShapes | None = None) -> dict[str, str]:
        """Each family as `cpu-native (<isa>)`, the ISA the kernels were loaded for (`NativeKernels.isa`);
        for a model that is not bf16, torch (the kernels take bf16 only)."""
        if served is not None and served.dtype != torch.bfloat16:
            return {family: f"torch [{dtype_name(served.dtype)} model]" for family in self.families}
        native = f"cpu-native ({self.k.isa})"
        out = {family: native for family in self.families}
        if served is not None:
            out["moe"] = f"{native} [router on torch above {FUSED_MAX_TOKENS} rows]"
        return out

    # dense -------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The GEMV kernel up to MAX_ROWS rows, the tile kernel up to AMX_ROWS where the CPU has tiles
        (AMX or AVX512-BF16; batched decode: oneDNN reorders the weight on every such call), else `F.linear`."""
        if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.is_cpu and w.is_contiguous():
            k = x.shape[-1]
            rows = x.shape[0] if x.dim() == 2 else (x.numel() // k if k else 0)
            if 0 < rows <= self.k.multi_rows(k):
                flat = x if x.dim() == 2 else x.reshape(rows, k)
                y = self.k.linear_bf16(flat, w) if rows <= MAX_ROWS else self.k.linear_bf16_multi(flat, [w])[0]
                return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])
            # no rows, or more than the kernels take: oneDNN's GEMM by design, not a fallback
        else:
            fallback(
                "linear", "device" if not x.is_cpu else "layout" if w.dtype == x.dtype == torch.bfloat16 else "dtype"
            )
        return super().linear(x, w)

    def linears(self, x, ws, f32=None):
        """All projections of one input in one native call (one pass of the threads over their
        weights) for bf16 batches of up to `multi_rows` rows."""
        f32 = f32 or (False,) * len(ws)
        rows = x.shape[0] if x.dim() == 2 else 0
        if (
            x.dtype == torch.bfloat16
            and 0 < rows <= self.k.multi_rows(x.shape[1])
            and len(ws) <= self.k.MAX_MULTI
            and all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in ws)
        ):
            return self.k.linear_bf16_multi(x, list(ws), list(f32))
        return super().linears(x, ws, f32)

    def rms_norm(self, x, w, eps, prepared=None):
        if prepared is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1:
            return self.k.rms_norm(x, prepared, eps)
        fallback("rms_norm", "unprepared" if prepared is None else "dtype" if x.dtype != torch.bfloat16 else "layout")
        return super().rms_norm(x, w, eps)

    def argmax_rows(self, logits):
        if logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_cpu and logits.shape[1] > 0:
            return self.k.argmax_rows(logits.contiguous())
        if logits.numel():
            fallback(
                "argmax_rows", "dtype" if logits.dtype != torch.float32 else "device" if not logits.is_cpu else "shape"
            )
        return super().argmax_rows(logits)

    def attn_res(self, cur, bank, proj, norm, prepared=None, then=None):
        """The mix (and the norm after it) in one call for bf16 [N, D] inputs."""
        if (
            prepared is None
            or cur.dtype != torch.bfloat16
            or cur.dim() != 2
            or len(bank) >= self.k.MAX_MIX
            or (then is not None and then[2] is None)
        ):
            unprepared = prepared is None or (then is not None and then[2] is None)
            fallback("attn_res", "unprepared" if unprepared else "dtype" if cur.dtype != torch.bfloat16 else "shape")
            return super().attn_res(cur, bank, proj, norm, prepared, then)
        if then is None:
            return self.k.attn_res_mix([*bank, cur], prepared, ATTN_RES_EPS)
        return self.k.attn_res_mix([*bank, cur], prepared, ATTN_RES_EPS, then[2], then[1])

    def glu_mlp(self, x, gate, up, down, act):
        """Up to MAX_ROWS tokens (AMX_ROWS on tiles) as one fused call (the MoE kernel with a
        single expert of weight 1, rounding exactly as the three linears and the activation); more
        tokens run the linears as GEMMs with the native GLU between them."""
        n = x.shape[0]
        if (
            x.dtype != torch.bfloat16
            or x.dim() != 2
            or n == 0
            or not all(w.dtype == torch.bfloat16 for w in (gate, up, down))
        ):
            if n:
                fallback("glu_mlp", "shape" if x.dim() != 2 else "dtype")
            return super().glu_mlp(x, gate, up, down, act)
        if n <= (AMX_ROWS if self.k.tiles else MAX_ROWS):
            return self.k.moe_experts(
                x, *_single_expert_routing(n), gate.unsqueeze(0), up.unsqueeze(0), down.unsqueeze(0), *act_spec(act)
            )
        return self.linear(self.k.glu_rows(self.linear(x, gate), self.linear(x, up), *act_spec(act)), down)

    # MoE ---------------------------------------------------------------------------------------
    def route(self, x, gate, bias, spec: RouteSpec, down=None):
        """Small bf16 batches: the fp32 router logits and the latent input in one native pass over
        both weights, the selection by the native kernel (one call instead of ~25 torch ops)."""
        if x.dtype == torch.bfloat16 and 0 < x.shape[0] <= FUSED_MAX_TOKENS:
            ws = [gate] if down is None else [gate, down]
            outs = self.linears(x, ws, (True, False)[: len(ws)])
            picked = self.k.route(outs[0], bias, *spec.args())
            if picked is not None:
                return *picked, x if down is None else outs[1]
        if x.shape[0]:
            fallback(
                "route", "dtype" if x.dtype != torch.bfloat16 else "rows" if x.shape[0] > FUSED_MAX_TOKENS else "shape"
            )
        return super().route(x, gate, bias, spec, down)

    def expert_views(self, ex: ExpertWeights) -> tuple:
        if not ex.packed or ex.dtype != torch.bfloat16:
            return super().expert_views(ex)
        return tuple(PackedExpertView(pair, ex.dtype, self._decode_bf16) for pair in ex.operands())

    def _decode_bf16(self, packed, scale, dtype):
        return self.k.mxfp4_to_bf16(packed, scale) if dtype == torch.bfloat16 else mxfp4_decode(packed, scale, dtype)

    def experts(self, x, ids, weights, ex, act):
        """Small batches (any batch on tiles: AMX or AVX512-BF16 registers, MXFP4 decoded in the weight
        loads) run the fused kernel; larger ones per-expert GEMMs."""
        if x.dtype != torch.bfloat16 or not (ex.packed or ex.w1.dtype == torch.bfloat16):
            fallback("experts", "dtype")
            return super().experts(x, ids, weights, ex, act)
        if 0 < x.shape[0] <= FUSED_MAX_TOKENS or self.k.tiles:
            return self.k.moe_experts(x, ids, weights, *ex.operands(), *act_spec(act))
        return self.grouped_experts(x, ids, weights, ex, act)

    @torch.no_grad()
    def grouped_experts(self, x, ids, weights, ex: ExpertWeights, act: GluAct) -> torch.Tensor:
        """`experts` for larger bf16 batches in few passes: one gather of the routed rows in expert
        order, per active expert one [M, 2I] gate+up GEMM (packed: both decoded into one buffer) or
        two GEMMs (dense), the native GLU on its halves, the down GEMM written straight into the
        expert-ordered outputs, then the native fp32 slot-order combination. Each expert's GEMMs run
        on its rows rounded up to a multiple of ROW_BUCKET (surplus rows are the next expert's or
        padding, overwritten or never read), so oneDNN sees few distinct shapes: a new shape costs
        ~4 ms of primitive creation, more than the GEMM."""
        n, k = ids.shape
        num_experts = (ex.w1[0] if ex.packed else ex.w1).shape[0]
        width = ex.w2[0].shape[2] * 2 if ex.packed else ex.w2.shape[2]
        d_in = x.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        positions = torch.empty_like(order)
        positions[order] = torch.arange(order.numel())
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        pad = torch.zeros(ROW_BUCKET, dtype=order.dtype)
        xs = x[torch.cat([order // k, pad])]
        ys = torch.empty(n * k + ROW_BUCKET, d_in, dtype=torch.bfloat16)
        if ex.packed:
            w13 = torch.empty(2 * width, d_in, dtype=torch.bfloat16)
            w2 = torch.empty(d_in, width, dtype=torch.bfloat16)
        kind = act_spec(act)
        start = 0
        for e, m in enumerate(counts):
            if m == 0:
                continue
            rows = slice(start, start + -(-m // ROW_BUCKET) * ROW_BUCKET)
            start += m
            if ex.packed:
                self.k.mxfp4_to_bf16(ex.w1[0][e], ex.w1[1][e], out=w13[:width])
                self.k.mxfp4_to_bf16(ex.w3[0][e], ex.w3[1][e], out=w13[width:])
                self.k.mxfp4_to_bf16(ex.w2[0][e], ex.w2[1][e], out=w2)
                h = torch.mm(xs[rows], w13.t())
                gate, up, down = h[:, :width], h[:, width:], w2
            else:
                gate, up, down = torch.mm(xs[rows], ex.w1[e].t()), torch.mm(xs[rows], ex.w3[e].t()), ex.w2[e]
            torch.mm(self.k.glu_rows(gate, up, *kind), down.t(), out=ys[rows])
        return self.k.moe_combine(ys[: n * k], positions.view(n, k), weights)

    def moe_block(self, x, prepared, otherwise, reduce):
        """The block plan over bf16 rows within its window, its partial output reduced; else, or where
        the router's limits decline the step, `otherwise()` (not a fallback: per-op kernels run)."""
        if (
            prepared is None
            or prepared[2]
            or x.dtype != torch.bfloat16
            or x.dim() != 2
            or not 0 < x.shape[0] <= self.k.moe_block_rows(prepared[0])
        ):
            return otherwise()
        out = self.k.moe_block(prepared[0], x)
        return otherwise() if out is None else reduce(out)

    def prepare_norm(self, w):
        return w.detach().float().contiguous()

    def prepare_attn_res(self, proj, norm):
        return (norm.detach().reshape(-1).float() * proj.detach().reshape(-1).float()).contiguous()

    def prepare_moe(self, w: MoeWeights):
        """(plan, the kernel's weight bundle that keeps its tensors alive, stack only), or None: bf16
        weights only; none where a shared expert has another activation. Stack only where the block
        would normalise a tensor-parallel partial sum (K3's latent norm under TP > 1): `moe_block`
        declines it, the whole-stack step runs it with the all-reduce before the norm; elsewhere the
        block's output is linear in the shards and the layer all-reduces it."""
        if not self.fuse_blocks:
            return None
        if w.shared is not None and act_spec(w.shared_act) != act_spec(w.act):
            return None
        kw = MoeBlockWeights(
            gate=w.gate.detach(),
            bias=None if w.bias is None else w.bias.detach().float().contiguous(),
            experts=tuple(t if isinstance(t, tuple) else t.detach() for t in w.experts.operands()),
            down=w.down,
            up=w.up,
            norm_w=None if w.norm is None else self.prepare_norm(w.norm),
            shared=w.shared,
            first=w.first,
        )
        plan = self.k.moe_block_plan(kw, w.route.args(), act_spec(w.act), w.norm_eps)
        return None if plan is None else (plan, kw, w.partial and w.norm is not None)
