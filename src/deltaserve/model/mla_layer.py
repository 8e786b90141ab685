"""NoPE Multi-head Latent Attention layer (spec/model.md §7).

Without earlier context the plain (unabsorbed) form runs over the new tokens; with a cached
context a prefill chunk decompresses the context's rows into keys and values and runs the same
form over them (cheaper from ~170 queries a sequence on), while decode attends over the latent
rows `[c_hat | k_rot]` directly in the absorbed form.
`DcpMlaAttention` is the layer built under decode context parallelism (`tp.dcp_world` > 1).
"""

from __future__ import annotations

import torch

from ..parallel import SINGLE, ParallelContext, shard
from .config import ModelConfig
from .context import ForwardContext
from .modules import OpsModule, RMSNorm, empty_linear, project


class MlaAttention(OpsModule):
    """Under tensor parallelism (`tp`) each rank holds H/W heads: q_proj / q_b_proj, kv_b_proj
    and g_proj by head rows, o_proj by head columns (its output all-reduced); q_a_proj,
    kv_a_proj_with_mqa and their norms are replicated (every rank caches the same latent rows)."""

    native_kernels = True  # `prepare_model` builds the backend's decode plans for this layer

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext = SINGLE):
        super().__init__()
        m = cfg.mla
        d = cfg.hidden_size
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = h = tp.split(m.num_heads, "MLA heads")
        self.nope, self.rope, self.v_dim, self.rank = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        )
        self.scale = m.qk_head_dim**-0.5
        if m.q_lora_rank is not None:
            self.q_a_proj = empty_linear(d, m.q_lora_rank)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.latent_norm_eps)
            self.q_b_proj = empty_linear(m.q_lora_rank, h * m.qk_head_dim)
        else:
            self.q_proj = empty_linear(d, h * m.qk_head_dim)
        self.kv_a_proj_with_mqa = empty_linear(d, m.latent_dim)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.latent_norm_eps)
        self.kv_b_proj = empty_linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim))
        if m.output_gate:
            self.g_proj = empty_linear(d, h * m.v_head_dim)
        self.o_proj = empty_linear(h * m.v_head_dim, d)
        for name in ("q_b_proj", "q_proj", "kv_b_proj", "g_proj"):
            if hasattr(self, name):
                shard(getattr(self, name).weight, 0)
        shard(self.o_proj.weight, 1)

    def input_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_a_proj(x) or q_proj(x), kv_a_proj_with_mqa(x), g_proj(x) or None), in one pass."""
        first = self.q_a_proj if hasattr(self, "q_a_proj") else self.q_proj
        gated = hasattr(self, "g_proj")
        outs = project(x, first, self.kv_a_proj_with_mqa, *((self.g_proj,) if gated else ()))
        return outs[0], outs[1], outs[2] if gated else None

    def queries(self, q_first: torch.Tensor) -> torch.Tensor:
        """[N, H, nope + rope] from q_a_proj(x) (then norm and q_b_proj) or q_proj(x)."""
        q = self.q_b_proj(self.q_a_layernorm(q_first)) if hasattr(self, "q_a_proj") else q_first
        return q.view(q_first.shape[0], self.num_heads, self.nope + self.rope)

    def latents(self, kv: torch.Tensor) -> torch.Tensor:
        """The cached row of each token from kv = kv_a_proj_with_mqa(x): [kv_a_layernorm(c) | k_rot]."""
        return torch.cat([self.kv_a_layernorm(kv[:, : self.rank]), kv[:, self.rank :]], dim=-1)

    def kv_b_split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV [H, v, R]) views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cache = ctx.cache
        if cache is not None and cache.decode_only:
            pool_view = self._view(cache, "mla_pool_view")
            o, gate = self.ops.mla_block(x, self.prepared, pool_view, lambda: self._attend(x, ctx))
        else:
            o, gate = self._attend(x, ctx)
        return self._output(o.reshape(x.shape[0], self.num_heads * self.v_dim), gate)

    def _output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o_proj(o * sigmoid(gate)) of o [N, H * v], all-reduced over the TP group."""
        if gate is not None:
            o = self.ops.sigmoid_gate(o, gate)
        return self.tp.all_reduce(self.o_proj(o))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [N, H, nope + rope], latent rows [N, R + Dr], gate or None) of the new tokens."""
        q_first, kv, gate = self.input_projections(x)
        return self.queries(q_first), self.latents(kv), gate

    def _attend(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(o [N, H, v], gate or None): projections, the cache write and the backend's attention."""
        q, latent, gate = self._project(x)
        if ctx.cache is not None:
            ctx.cache.store_mla(self.layer_id, latent)
        return self._attention(q, latent, ctx.cache, ctx.cu_seqlens), gate

    def _attention(self, q, latent, cache, cu_seqlens):
        w_kv = self.kv_b_proj.weight
        return self.ops.mla_attend(
            q, latent, w_kv, cache, self.layer_id, cu_seqlens, self.rank, self.scale, self.prepared
        )

    def _latent_queries(self, q):
        w_uk, _ = self.kv_b_split()
        q_hat = torch.einsum("nhd,hdr->nhr", q[..., : self.nope], w_uk)
        return torch.cat([q_hat, q[..., self.nope :]], dim=-1)

    def _values(self, o_lat):
        return torch.einsum("nhr,hvr->nhv", o_lat, self.kv_b_split()[1])

    def _view(self, cache, name: str):
        """The pool view `name` of this layer (`context.LayerCache`), or None where the cache has none."""
        view = getattr(cache, name, None)
        return None if view is None else view(self.layer_id)


class DcpMlaAttention(MlaAttention):
    """MLA under decode context parallelism: the TP heads and weights of `MlaAttention`, but this
    rank caches only the positions t with t % D == `tp.dcp_rank` (D = `tp.dcp_world`).

    Per step (prefill chunk or decode, the same exact path): every rank computes its heads' latent
    queries and the latent rows of all new tokens, stores its own positions, all-gathers the
    queries over the DCP group (its D ranks' heads), attends with every gathered head over its
    local rows (`ops.mla.mla_absorbed_partial`, causal by global position; a decode step, where each
    query sees all its rows, through `ops.mla_decode_partial` over the pool in place where the backend
    has it; both behind `ops.mla_dcp_partial`), all-gathers the (partial output, LSE) pairs, merges its own heads' parts
    (`ops.lse_merge`), then W_UV, gate and the row-parallel o_proj as under TP. The whole-context
    native decode kernels are not called and there is no prepared plan (`native_kernels`). Without a
    cache (`forward_full`) every position is local and the plain TP attention runs."""

    native_kernels = False

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        o, gate = self._attend(x, ctx)
        return self._output(o.reshape(x.shape[0], self.num_heads * self.v_dim), gate)

    def _attend(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, latent, gate = self._project(x)
        cache = ctx.cache
        if cache is None:
            return self._attention(q, latent, None, ctx.cu_seqlens), gate
        if not hasattr(cache, "mla_dcp_context"):
            raise TypeError(f"{type(cache).__name__} has no mla_dcp_context: it cannot serve a DCP MLA layer")
        cache.store_mla(self.layer_id, latent)
        q_all = self.tp.dcp_all_gather(self._latent_queries(q), dim=1)
        o, lse = self.ops.mla_dcp_partial(q_all, cache, self.layer_id, ctx.cu_seqlens, self.rank, self.scale)
        h, d = self.num_heads, self.tp.dcp_rank
        parts = self.tp.dcp_all_gather(torch.cat([o, lse[..., None]], dim=-1)[None], dim=0)
        parts = parts[:, :, d * h : (d + 1) * h]
        o_lat, _ = self.ops.lse_merge(parts[..., : self.rank], parts[..., self.rank])
        return self._values(o_lat.to(q.dtype)), gate
