"""The op seam: one method per op family, bound once per model (`ops.backends.select.select_ops`).

`TorchOps` is the reference implementation of every family in pure PyTorch (the default for
any device and dtype, and the oracle of the others); a backend (`ops.backends.cpu.CpuNativeOps`,
later Triton) subclasses it and overrides what it runs faster. Model layers call only these
methods on their bound backend and never choose kernels themselves.

Whole-block decode plans are built once after loading (`prepare_*`, called by
`model.fused.prepare_model`) from the weight bundles of `ops.operands`; the reference builds none. A
method that takes `prepared` accepts None (nothing prepared) and must then give the reference
result. Every method answers: a whole-plan method (`moe_block`, `kda_decode`, `mla_block`,
`decode_stack`, `decode_logits`) takes `otherwise`, the layer's module-by-module path as a callable,
and returns its result where the plan does not apply (the reference calls it always). Only the
in-place MLA hooks (`mla_decode`, `mla_extend`, `mla_decode_partial`) return None, to this class's
own composition (`mla_attend`, `mla_dcp_partial`), never to a layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import kda as kda_ops
from .. import mla as mla_fns
from ..attn_res import attn_res_mix
from ..mla import (
    joined_keys,
    mla_absorbed_attention,
    mla_context_attention,
    mla_prefill_attention,
    unabsorbed_row_bytes,
)
from ..moe import grouped_experts, route
from ..mxfp4 import mxfp4_decode
from ..norms import gated_rms_norm, rms_norm
from ..operands import (
    ExpertWeights,
    GluAct,
    KdaSpec,
    KdaWeights,
    MlaWeights,
    MoeWeights,
    PackedExpertView,
    RouteSpec,
    ServedShapes,
)
from ..vision import image_attention, packed_attention
from . import mla_attend


class TorchOps:
    """Every op family in pure PyTorch: the reference (see the module docstring)."""

    name = "torch"
    families = ("linear", "norms", "attn_res", "glu", "moe", "kda", "mla")

    def describe(self, served: ServedShapes | None = None) -> dict[str, str]:
        """Op family -> what implements it (logged at start-up): for a model of `served`'s dtypes and
        shapes, what its calls will run (a kernel window that refuses them is named), else the
        backend's kernels."""
        return {family: "torch" for family in self.families}

    # dense -------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`x @ w.T` (bias-free, as every linear of this family)."""
        return F.linear(x, w)

    def linears(
        self, x: torch.Tensor, ws: list[torch.Tensor], f32: tuple[bool, ...] | None = None
    ) -> list[torch.Tensor]:
        """`[linear(x, w) for w in ws]`, or the fp32 `x.float() @ w.float().T` where `f32[i]`."""
        f32 = f32 or (False,) * len(ws)
        return [x.float() @ w.float().T if f else self.linear(x, w) for w, f in zip(ws, f32)]

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, prepared=None) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row of logits [N, V]: `argmax(dim=-1)` (the first largest; NaN largest)."""
        return logits.argmax(dim=-1)

    def attn_res(
        self,
        cur: torch.Tensor,
        bank: list[torch.Tensor],
        proj: torch.Tensor,
        norm: torch.Tensor,
        prepared=None,
        then: tuple | None = None,
    ) -> torch.Tensor:
        """`attn_res_mix(cur, bank, proj, norm)`, then `rms_norm(., *then)` if `then` = (w, eps, prepared)."""
        mixed = attn_res_mix(cur, bank, proj, norm)
        return mixed if then is None else self.rms_norm(mixed, *then)

    def glu_mlp(
        self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: GluAct
    ) -> torch.Tensor:
        """`down(act(gate(x), up(x)))`."""
        return self.linear(act(self.linear(x, gate), self.linear(x, up)), down)

    # MoE ---------------------------------------------------------------------------------------
    def route(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        bias: torch.Tensor | None,
        spec: RouteSpec,
        down: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, ids) of `ops.moe.route` and the routed experts' input (`x @ down.T`, or x)."""
        weights, ids = route(x, gate, bias, *spec.args())
        return weights, ids, x if down is None else self.linear(x, down)

    def expert_views(self, ex: ExpertWeights) -> tuple:
        """`[E, O, I]`-indexable experts for `grouped_experts` (packed ones decoded per expert)."""
        if not ex.packed:
            return ex.operands()
        return tuple(PackedExpertView(pair, ex.dtype, mxfp4_decode) for pair in ex.operands())

    def experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ex: ExpertWeights, act: GluAct
    ) -> torch.Tensor:
        """`ops.moe.grouped_experts` semantics: x [N, Din] -> [N, Din] in x's dtype."""
        return grouped_experts(x, ids, weights, *self.expert_views(ex), act, linear=self.linear)

    def local_experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ex: ExpertWeights, act: GluAct, first: int
    ) -> torch.Tensor:
        """`experts` for a rank holding the experts [first, first + ex.num) of the router's `ids`:
        the (token, slot) pairs routed there run as one `experts` call on the gathered rows (one slot
        each, weight 1, so each expert output comes back exactly); pairs routed elsewhere are
        dropped, never computed. Returns x.dtype(sum over the local pairs of w * y) with the
        weighted sum in fp32 (slot order on CPU): this rank's partial sum of the full `experts`."""
        local = ids - first
        tok, slot = ((local >= 0) & (local < ex.num)).nonzero(as_tuple=True)
        acc = torch.promote_types(x.dtype, torch.float32)
        out = torch.zeros(x.shape, dtype=acc, device=x.device)
        if tok.numel():
            ones = torch.ones(tok.numel(), 1, dtype=weights.dtype, device=weights.device)
            ys = self.experts(x[tok], local[tok, slot, None], ones, ex, act)
            out.index_add_(0, tok, weights[tok, slot, None].to(acc) * ys.to(acc))
        return out.to(x.dtype)

    def moe_block(
        self,
        x: torch.Tensor,
        prepared,
        otherwise: Callable[[], torch.Tensor],
        reduce: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """A MoE block's output: the whole block in one call, its partial sum reduced by `reduce`, where
        the backend's plan applies; else `otherwise()` (the layer's route, experts and shared experts,
        reduced by the layer)."""
        return otherwise()

    # KDA ---------------------------------------------------------------------------------------
    def kda_decode(
        self, x: torch.Tensor, prepared, slot_view, otherwise: Callable[[], torch.Tensor], record=None
    ) -> torch.Tensor:
        """A decode step of a KDA layer (its output after o_proj, before the TP reduce): over the pool's
        slots in place where the backend's kernels apply, else `otherwise()` (the layer's `kda_attend`
        path). `record` (or None): the step's `KdaRecord.layer` for this layer, which a backend that
        records its rows' KDA inputs calls (ops/kda_record.py); one that does not leaves it alone."""
        return otherwise()

    def replay_kda(self, record, views: dict, rows: list[int], slots: list[int]) -> bool:
        """Apply again the KDA updates alone of a decode step's rows `rows` (on `slots`, in order)
        from its `KdaRecord` (ops/kda_record.py) to the pools `views` ({KDA layer: (tails,
        states)}, every KDA layer of the model); False (nothing done) where this backend keeps
        no record or some layer's is missing."""
        return False

    def kda_attend(
        self,
        pre: torch.Tensor,
        f: torch.Tensor,
        beta: torch.Tensor,
        gate: torch.Tensor,
        conv: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm: torch.Tensor,
        spec: KdaSpec,
        cu_seqlens: torch.Tensor,
        prior,
        export_offsets,
        step: bool,
        prepared=None,
    ):
        """KDA from the projections: pre = [q|k|v] pre-conv [N, 3P], f [N, P] gate input, beta [N, H]
        (post-sigmoid, fp32), gate [N, H, K] output-gate logits. `prior` = (tails, states) or None;
        `step`: one token per sequence from `prior` (the recurrent form, states updated in place).
        Returns (normed output [N, H, V] in pre's dtype, final tails, final states,
        (tails_at, states_at) at `export_offsets` or None)."""
        n, h, dk = pre.shape[0], spec.heads, spec.head_dim
        if step:
            mixed, tail = kda_ops.causal_conv1d_step(pre, conv, prior[0])
        else:
            mixed, tail = kda_ops.causal_conv1d(pre, conv, cu_seqlens, prior[0] if prior is not None else None)
        q, k, v = mixed.view(n, 3, h, dk).unbind(1)
        q, k = kda_ops.l2_norm(q), kda_ops.l2_norm(k)
        g = self._kda_gate(f.view(n, h, dk), a_log, dt_bias, spec)
        state = prior[1] if prior is not None else None
        if step:
            o = kda_ops.kda_recurrent_step(q, k, v, g, beta, state, spec.scale)
            exported = None
        else:
            o, state, states_at = kda_ops.kda_chunked(
                q, k, v, g, beta, cu_seqlens, spec.scale, initial_state=state, export_offsets=export_offsets
            )
            exported = self._exports(pre, cu_seqlens, prior, export_offsets, conv.shape[-1], states_at)
        return gated_rms_norm(o, norm, gate, spec.eps, pre.dtype), tail, state, exported

    @staticmethod
    def _kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, spec: KdaSpec) -> torch.Tensor:
        if spec.lower_bound is not None:
            return kda_ops.kda_gate_sigmoid(f, a_log, dt_bias, spec.lower_bound)
        return kda_ops.kda_gate_softplus(f, a_log, dt_bias)

    @staticmethod
    def _exports(pre, cu_seqlens, prior, offsets, width, states_at):
        """(conv tails, states) at the export offsets, or None when none were asked for."""
        if offsets is None:
            return None
        tails_at = kda_ops.conv_tails_at(pre, cu_seqlens, prior[0] if prior is not None else None, offsets, width)
        return tails_at, states_at

    # MLA ---------------------------------------------------------------------------------------
    def sigmoid_gate(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """MLA's output gate `o * sigmoid(gate)`."""
        return o * torch.sigmoid(gate)

    def decode_stack(self, x: torch.Tensor, prepared, cache, otherwise: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The final-normed hidden states of a whole decode step of the embeddings x: every layer in
        one call (`prepare_stack`) where the plan applies, else `otherwise()` (the layers one by one)."""
        return otherwise()

    def decode_logits(self, ids: torch.Tensor, prepared, cache, otherwise: Callable[[], torch.Tensor]) -> torch.Tensor:
        """fp32 logits of a whole decode step of the token ids: `decode_stack` with the embedding lookup
        before it and the output head after, in one call, where the plan holds them; else `otherwise()`
        (the model's forward and head)."""
        return otherwise()

    def mla_block(self, x: torch.Tensor, prepared, pool_view, otherwise: Callable[[], tuple]) -> tuple:
        """(o [N, H, v], gate or None) of an MLA decode step: in one call (projections, norms, the pool
        write, absorbed attention) where the block plan applies, else `otherwise()` (the layer's
        modules). Reads whole contexts: not DCP-aware (a `DcpMlaAttention` layer never calls it, nor
        `mla_decode`, nor `prepare_mla`)."""
        return otherwise()

    def mla_decode_partial(self, q_latent: torch.Tensor, rows_view, rank: int, scale: float) -> tuple | None:
        """Decode context parallelism: (o fp32 [B, H, R], lse fp32 [B, H]) of one latent query per
        sequence over this rank's rows of its context, read in place (`rows_view`: pool rows, read_rows,
        cu_kv), as `ops.mla.mla_absorbed_partial` gives them for queries that see every row; or None
        (the layer gathers the rows and runs that)."""
        return None

    def mla_attend(
        self, q, latent, w_kv, cache, layer_id: int, cu_seqlens, rank: int, scale: float, prepared=None
    ) -> torch.Tensor:
        """o [N, H, v] of an MLA layer's step: the in-place kernels where they fit, else the gathered
        context in the cheaper form per sequence, or causal within the step without a cache
        (`mla_attend.attend`, composed from this backend's ops)."""
        return mla_attend.attend(self, q, latent, w_kv, cache, layer_id, cu_seqlens, rank, scale, prepared)

    def mla_dcp_partial(self, q_all: torch.Tensor, cache, layer_id: int, cu_q: torch.Tensor, rank: int, scale: float):
        """Decode context parallelism: (o fp32 [N, H, R], lse fp32 [N, H]) of the gathered latent
        queries over this rank's rows of their contexts, causal by global position. A decode step,
        where each query sees all its rows, reads the pool in place where the backend can
        (`mla_decode_partial`); otherwise the rows the cache gathers (`mla_dcp_context`) go to
        `mla.mla_absorbed_partial`."""
        if cache.decode_only and hasattr(cache, "mla_dcp_rows_view"):
            part = self.mla_decode_partial(q_all, cache.mla_dcp_rows_view(layer_id), rank, scale)
            if part is not None:
                return part
        rows, kv_pos, cu_kv, q_pos = cache.mla_dcp_context(layer_id)
        return mla_fns.mla_absorbed_partial(q_all, rows, q_pos, kv_pos, cu_q, cu_kv, rank, scale)

    def lse_merge(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(merged output, total lse) of partial attentions [P, ...] over disjoint rows (`mla.lse_combine`)."""
        return mla_fns.lse_combine(o, lse)

    # vision ------------------------------------------------------------------------------------
    def vision_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The vision tower's bidirectional attention within each of the packed images of `lengths`
        rows (`vision.packed_attention`: per image, queries in bounded chunks, no mask)."""
        return packed_attention(q, k, v, lengths)

    def vision_image_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Queries `q` (any rows of one image) against that image's whole `k, v` (`vision.image_attention`)."""
        return image_attention(q, k, v)

    def mla_decode(
        self, q: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, rows_view, rank: int, scale: float, prepared=None
    ) -> torch.Tensor | None:
        """Absorbed decode attention reading the pool's rows in place ([N, H, v]), or None (`mla_attend`
        gathers its context and runs `ops.mla`)."""
        return None

    def mla_extend(
        self,
        q: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        rows_view,
        cu_q: torch.Tensor,
        rank: int,
        scale: float,
    ) -> torch.Tensor | None:
        """Absorbed attention of a step with several queries per sequence (cu_q) over the contexts in
        the pool, read in place ([N, H, v]), or None (`mla_attend` gathers its context)."""
        return None

    def mla_absorbed(
        self,
        q_latent: torch.Tensor,
        rows: torch.Tensor,
        cu_q: torch.Tensor,
        cu_kv: torch.Tensor,
        rank: int,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed attention of a step's latent queries [N, H, R + Dr] (packed by cu_q) over each
        sequence's latent rows [Nkv, R + Dr] (packed by cu_kv; keys the whole rows, values their first R
        columns): [N, H, R] in the queries' dtype (`mla.mla_absorbed_attention`)."""
        return mla_absorbed_attention(q_latent, rows, cu_q, cu_kv, rank, scale)

    def unabsorbed_row_bytes(self, heads: int, rope: int, nope: int, v: int) -> int:
        """Bytes a decompressed context row holds in `mla_context_prefill` (`mla.unabsorbed_row_bytes`)."""
        return unabsorbed_row_bytes(heads, rope, nope, v)

    def mla_context_prefill(
        self,
        q: torch.Tensor,
        k_nope: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_kv: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Unabsorbed attention of a step's queries (packed by cu_q) over each sequence's whole
        context, its rows decompressed (k_nope [Nkv, H, Dn], k_rot [Nkv, Dr], v [Nkv, H, Dv], packed
        by cu_kv): [N, H, Dv] in q's dtype (`mla.mla_context_attention`)."""
        return mla_context_attention(q, joined_keys(k_nope, k_rot), v.contiguous(), cu_q, cu_kv, scale)

    def mla_prefill(
        self,
        q: torch.Tensor,
        k_nope: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Causal unabsorbed attention within each packed sequence, [N, H, Dv] in q's dtype: q
        [N, H, Dn + Dr], k_nope [N, H, Dn], k_rot [N, Dr] shared by the heads, v [N, H, Dv]."""
        return mla_prefill_attention(q, joined_keys(k_nope, k_rot), v.contiguous(), cu_seqlens, scale)

    # plans -------------------------------------------------------------------------------------
    def prepare_norm(self, w: torch.Tensor):
        return None

    def prepare_attn_res(self, proj: torch.Tensor, norm: torch.Tensor):
        return None

    def prepare_kda(self, w: KdaWeights, spec: KdaSpec):
        return None

    def prepare_mla(self, w: MlaWeights):
        return None

    def prepare_experts(self, ex: ExpertWeights, act: GluAct) -> None:
        """Called at load for every layer's routed experts, whole or an expert-parallel slice
        (where no block plan is made): a backend converting them for its kernels does it here."""

    def prepare_moe(self, w: MoeWeights):
        return None

    def prepare_stack(self, stack):
        """The whole-stack decode plan of `stack` (`ops.stack.StackOperands`), or None."""
        return None


REFERENCE = TorchOps()
