"""ctypes bindings of the native whole-block kernels (`csrc/blocks.c`): a block's static part
(weight pointers, sizes, router and activation constants) is described once in a plan, and each
call passes only the activations."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .abi import MLA_MAX_HEADS, MLA_MAX_RANK, STRUCTS
from .attention import kda_pool_fits
from .decode import expert_operands

MoeBlockPlan = STRUCTS["ds_moe_block_t"]
KdaBlockPlan = STRUCTS["ds_kda_block_t"]
MlaBlockPlan = STRUCTS["ds_mla_block_t"]


@dataclass
class KdaBlockWeights:
    """The tensors of one KDA layer's decode step as `ds_kda_block` reads them."""

    q: torch.Tensor  # q/k/v [P, D] bf16
    k: torch.Tensor
    v: torch.Tensor
    f_a: torch.Tensor  # [K, D]
    f_b: torch.Tensor  # [P, K]
    b: torch.Tensor  # [H, D]
    g: torch.Tensor  # g_proj [P, D] (full-rank gate) or g_a_proj [K, D]
    g_b: torch.Tensor | None  # [P, K] (low-rank gate)
    o: torch.Tensor  # [D, P]
    conv_w: torch.Tensor  # [3P, W] fp32
    a_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [P] fp32
    norm_w: torch.Tensor  # [K] fp32


@dataclass
class MlaBlockWeights:
    """The tensors of one MLA layer's decode step as `ds_mla_block` reads them."""

    q_first: torch.Tensor  # q_a_proj [Rq, D] (or q_proj [H*(nope+rope), D]) bf16
    q_b: torch.Tensor | None  # [H*(nope+rope), Rq]
    q_norm: torch.Tensor | None  # [Rq] fp32
    kv_a: torch.Tensor  # [R + rope, D]
    kv_norm: torch.Tensor  # [R] fp32
    g: torch.Tensor | None  # [H*v, D]
    w_uk_t: torch.Tensor  # [H, R, nope] (contiguous copy)
    w_uv: torch.Tensor  # [H, v, R]


@dataclass
class MoeBlockWeights:
    """The tensors of one MoE block as `ds_moe_block` reads them (see MoeBlock.native_plan)."""

    gate: torch.Tensor  # [E, D] bf16
    bias: torch.Tensor | None  # [E] fp32
    experts: tuple  # (w1, w3, w2): bf16 [E, I, L] / [E, L, I] or (packed, scale) pairs
    down: torch.Tensor | None = None  # [L, D] bf16 (K3 latent)
    up: torch.Tensor | None = None  # [D, L] bf16
    norm_w: torch.Tensor | None = None  # [L] fp32
    shared: tuple[torch.Tensor, ...] | None = None  # gate/up [SI, D], down [D, SI] bf16
    first: int = 0  # the experts held are the router's [first, first + len(experts)) (expert parallelism)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _bf16(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    return t is None or (t.dtype == torch.bfloat16 and t.is_contiguous() and tuple(t.shape) == shape)


def kda_record_width(plan: KdaBlockPlan) -> int:
    """bf16 values a row takes in `kda_block`'s record: q, k, v, f (P each) and b (H)."""
    return 4 * plan.H * plan.K + plan.H


def kda_record_fits(record: torch.Tensor, n: int, plan: KdaBlockPlan) -> bool:
    """`record` is a contiguous bf16 buffer of n rows of `kda_record_width(plan)`."""
    return record.dtype == torch.bfloat16 and record.is_contiguous() and record.numel() == n * kda_record_width(plan)


class BlockBindings:
    """Mixin of `NativeKernels` (`self.lib`: the library, its signatures declared from ds_abi.h)."""

    lib: ctypes.CDLL

    def moe_block_plan(self, w: MoeBlockWeights, route: tuple, act: tuple, norm_eps: float) -> MoeBlockPlan | None:
        """A plan for `moe_block`, or None where the block's tensors do not fit the kernel (the caller
        runs the modules). `route` = (top_k, groups, topk_group, renormalize, scale, bias_in_weights),
        `act` = (kind, beta, linear_beta). The plan holds raw pointers: keep `w` alive with it."""
        e, d = w.gate.shape
        latent = w.down is not None
        width_in = w.down.shape[0] if latent else d
        experts = expert_operands(*w.experts, width_in)
        if experts is None or not (w.first >= 0 and 0 < experts[0] and w.first + experts[0] <= e):
            return None
        held, inter, packed, (p1, s1, p3, s3, p2, s2) = experts
        si = w.shared[0].shape[0] if w.shared is not None else 0
        ok = (
            _bf16(w.gate, (e, d))
            and _bf16(w.down, (width_in, d))
            and _bf16(w.up, (d, width_in))
            and (w.bias is None or (w.bias.dtype == torch.float32 and w.bias.is_contiguous() and w.bias.numel() == e))
            and (w.norm_w is None or (w.norm_w.dtype == torch.float32 and w.norm_w.numel() == width_in))
            and (
                w.shared is None
                or (_bf16(w.shared[0], (si, d)) and _bf16(w.shared[1], (si, d)) and _bf16(w.shared[2], (d, si)))
            )
        )
        if not ok or latent != (w.up is not None):
            return None
        top_k, groups, topk_group, renorm, scale, bias_in_weights = route
        kind, beta, lbeta = act
        sh = w.shared or (None, None, None)
        plan = MoeBlockPlan(
            d,
            e,
            width_in,
            inter,
            si,
            top_k,
            groups,
            topk_group,
            int(renorm),
            int(bias_in_weights),
            scale,
            norm_eps,
            beta or 0.0,
            lbeta or 0.0,
            kind,
            int(packed),
            *[_ptr(t) for t in (w.gate, w.bias, w.down, w.up, w.norm_w)],
            p1,
            p3,
            p2,
            s1 or None,
            s3 or None,
            s2 or None,
            *[_ptr(t) for t in sh],
        )
        plan.first, plan.held = w.first, held
        return plan

    def moe_block_rows(self, plan: MoeBlockPlan) -> int:
        """The most rows `moe_block` takes: what the projections of both widths (D, L) take."""
        return min(self.multi_rows(plan.D), self.multi_rows(plan.L))

    def moe_block(self, plan: MoeBlockPlan, x: torch.Tensor) -> torch.Tensor | None:
        """The MoE block of x [N <= moe_block_rows(plan), D] bf16, or None where the router's
        limits do not hold (nothing computed; the caller runs the modules)."""
        n, d = x.shape
        if not (x.dtype == torch.bfloat16 and d == plan.D and 0 < n <= self.moe_block_rows(plan)):
            raise ValueError("moe_block: bad input")
        x = x.contiguous()
        out = torch.empty(n, d, dtype=torch.bfloat16)
        rc = self.lib.ds_moe_block(ctypes.byref(plan), x.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
        if rc == -3:
            return None
        if rc != 0:
            raise MemoryError("moe_block: scratch allocation failed")
        return out

    def kda_block_plan(
        self, w: KdaBlockWeights, heads: int, gate_kind: int, lower_bound: float, eps: float, scale: float
    ) -> KdaBlockPlan | None:
        """A plan for `kda_block`, or None where the tensors do not fit the kernel. Keep `w` alive with it."""
        p, d = w.q.shape
        kd = w.f_a.shape[0]
        full = w.g_b is None
        f32 = (w.conv_w, w.a_log, w.dt_bias, w.norm_w)
        ok = (
            p == heads * kd
            and all(_bf16(t, (p, d)) for t in (w.q, w.k, w.v))
            and _bf16(w.f_a, (kd, d))
            and _bf16(w.f_b, (p, kd))
            and _bf16(w.b, (heads, d))
            and _bf16(w.g, (p if full else kd, d))
            and _bf16(w.g_b, (p, kd))
            and _bf16(w.o, (d, p))
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in f32)
            and w.conv_w.dim() == 2
            and w.conv_w.shape[0] == 3 * p
            and w.a_log.numel() == heads
            and w.dt_bias.numel() == p
            and w.norm_w.numel() == kd
        )
        if not ok:
            return None
        return KdaBlockPlan(
            d,
            heads,
            kd,
            w.conv_w.shape[1],
            int(full),
            gate_kind,
            lower_bound,
            eps,
            scale,
            *[_ptr(t) for t in (w.q, w.k, w.v, w.f_a, w.f_b, w.b, w.g, w.g_b, w.o, *f32)],
        )

    def kda_block_rows(self, plan: KdaBlockPlan) -> int:
        """The most rows `kda_block` takes: what its projections of widths D, K and P take."""
        return min(self.multi_rows(k) for k in (plan.D, plan.K, plan.H * plan.K))

    def kda_block(
        self,
        plan: KdaBlockPlan,
        x: torch.Tensor,
        tails: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        record: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One KDA decode step of x [N, D] bf16 (N within `multi_rows` of D, K and P), updating the
        pool's `tails` [S, W-1, 3P] bf16 and `states` [S, H, K, K] fp32 at `slots` in place.
        `record`: N x `kda_record_width(plan)` bf16 (contiguous), filled with the rows' KDA inputs
        (`ds_kda_block`'s record, what `kda_replay` reads)."""
        n, d = x.shape
        ok = (
            x.dtype == torch.bfloat16
            and d == plan.D
            and 0 < n <= self.kda_block_rows(plan)
            and kda_pool_fits(tails, states, plan.H, plan.K, plan.W)
            and slots.dtype == torch.int64
            and slots.numel() == n
            and (record is None or kda_record_fits(record, n, plan))
        )
        if not ok:
            raise ValueError("kda_block: operand shapes or dtypes disagree")
        x, slots = x.contiguous(), slots.contiguous()
        out = torch.empty(n, d, dtype=torch.bfloat16)
        rc = self.lib.ds_kda_block(
            ctypes.byref(plan),
            x.data_ptr(),
            n,
            tails.data_ptr(),
            states.data_ptr(),
            slots.data_ptr(),
            states.shape[0],
            _ptr(record),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError("kda_block: slot out of range")
        if rc != 0:
            raise MemoryError("kda_block: scratch allocation failed")
        return out

    def kda_replay(
        self,
        layers: list[tuple[KdaBlockPlan, torch.Tensor, torch.Tensor, torch.Tensor]],
        n: int,
        rows: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """The KDA updates alone of recorded rows, every layer in one call (`ds_kda_replay`): per
        (plan, record, tails, states) of `layers`, the record of a step's n rows (`kda_block`'s),
        its rows `rows` [M] int64 are applied on `slots` [M] in order, through `ds_kda_decode`: the
        pool is left as a `kda_block` of those rows leaves it. Rows sharing a slot must be adjacent."""
        m = rows.numel()
        ok = (
            rows.dtype == slots.dtype == torch.int64
            and slots.numel() == m
            and len({s.shape[0] for *_, s in layers}) <= 1
            and all(kda_record_fits(r, n, p) and kda_pool_fits(t, s, p.H, p.K, p.W) for p, r, t, s in layers)
        )
        if not ok:
            raise ValueError("kda_replay: operand shapes or dtypes disagree")
        if not (m and layers):
            return
        count = len(layers)
        ptrs = [(ctypes.c_void_p * count)(*(y[i].data_ptr() for y in layers)) for i in (1, 2, 3)]
        plans = (ctypes.c_void_p * count)(*(ctypes.addressof(y[0]) for y in layers))
        rows, slots = rows.contiguous(), slots.contiguous()
        rc = self.lib.ds_kda_replay(
            plans,
            count,
            ptrs[0],
            n,
            rows.data_ptr(),
            m,
            slots.data_ptr(),
            ptrs[1],
            ptrs[2],
            layers[0][3].shape[0],
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError("kda_replay: row or slot out of range")
        if rc != 0:
            raise MemoryError("kda_replay: scratch allocation failed")

    def mla_block_plan(
        self, w: MlaBlockWeights, heads: int, nope: int, rope: int, q_eps: float, kv_eps: float, scale: float
    ) -> MlaBlockPlan | None:
        """A plan for `mla_block`, or None where the tensors do not fit the kernel. Keep `w` alive with it."""
        d = w.kv_a.shape[1]
        rank, v = w.w_uk_t.shape[1], w.w_uv.shape[1]
        q_rank = w.q_b.shape[1] if w.q_b is not None else 0
        qd = nope + rope
        ok = (
            _bf16(w.q_first, (q_rank or heads * qd, d))
            and _bf16(w.q_b, (heads * qd, q_rank))
            and _bf16(w.kv_a, (rank + rope, d))
            and _bf16(w.g, (heads * v, d))
            and _bf16(w.w_uk_t, (heads, rank, nope))
            and _bf16(w.w_uv, (heads, v, rank))
            and (w.q_b is None) == (w.q_norm is None)
            and all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in (w.q_norm, w.kv_norm))
            and w.kv_norm.numel() == rank
            and (w.q_norm is None or w.q_norm.numel() == q_rank)
            and heads <= MLA_MAX_HEADS
            and rank <= MLA_MAX_RANK
        )
        if not ok:
            return None
        return MlaBlockPlan(
            d,
            heads,
            nope,
            rope,
            rank,
            v,
            q_rank,
            int(w.g is not None),
            q_eps,
            kv_eps,
            scale,
            *[_ptr(t) for t in (w.q_first, w.q_b, w.kv_a, w.g, w.q_norm, w.kv_norm, w.w_uk_t, w.w_uv)],
        )

    def mla_block_rows(self, plan: MlaBlockPlan) -> int:
        """The most rows `mla_block` takes: what its projections of widths D and q_rank take."""
        return min(self.multi_rows(k) for k in (plan.D, plan.q_rank or plan.D))

    def mla_block(
        self,
        plan: MlaBlockPlan,
        x: torch.Tensor,
        rows: torch.Tensor,
        write_rows: torch.Tensor,
        read_rows: torch.Tensor,
        cu_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(o [N, H*v], gate [N, H*v] or None) of one MLA decode step of x [N <= mla_block_rows(plan), D]
        bf16; the N latent rows are written into `rows` (the layer's pool [num_rows, R + rope] bf16) at
        write_rows."""
        n, d = x.shape
        hv = plan.H * plan.v
        ok = (
            x.dtype == torch.bfloat16
            and d == plan.D
            and 0 < n <= self.mla_block_rows(plan)
            and rows.dtype == torch.bfloat16
            and rows.is_contiguous()
            and rows.dim() == 2
            and rows.shape[1] == plan.rank + plan.rope
            and write_rows.dtype == read_rows.dtype == cu_kv.dtype == torch.int64
            and write_rows.numel() == n
            and cu_kv.numel() == n + 1
        )
        if not ok:
            raise ValueError("mla_block: operand shapes or dtypes disagree")
        x, write_rows, read_rows, cu_kv = (
            x.contiguous(),
            write_rows.contiguous(),
            read_rows.contiguous(),
            cu_kv.contiguous(),
        )
        o = torch.empty(n, hv, dtype=torch.bfloat16)
        gate = torch.empty(n, hv, dtype=torch.bfloat16) if plan.gated else None
        rc = self.lib.ds_mla_block(
            ctypes.byref(plan),
            x.data_ptr(),
            n,
            rows.data_ptr(),
            rows.shape[0],
            write_rows.data_ptr(),
            read_rows.data_ptr(),
            cu_kv.data_ptr(),
            o.data_ptr(),
            gate.data_ptr() if gate is not None else None,
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError("mla_block: row index out of range")
        if rc != 0:
            raise MemoryError("mla_block: scratch allocation failed")
        return o, gate
