"""Kimi Delta Attention layer (spec/model.md §6) driven with or without a cache."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.operands import KdaSpec
from ..parallel import SINGLE, ParallelContext, shard
from .config import ModelConfig
from .context import ForwardContext
from .modules import OpsModule, WeightVector, empty_linear


class KdaAttention(OpsModule):
    """Parameters carry the checkpoint names. `A_log` is stored flat `[H]` (the loader strips
    K3's padding and Kimi-Linear's 4-D form); conv weights stay `[P, 1, W]` fp32.

    Under tensor parallelism (`tp`) each rank holds H/W heads: q/k/v, the convs, f_b_proj,
    b_proj, the output gate's last projection, dt_bias and A_log by head rows, o_proj by head
    columns (its output all-reduced); f_a_proj, g_a_proj and o_norm are replicated."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext = SINGLE):
        super().__init__()
        k = cfg.kda
        self.tp = tp
        heads = tp.split(k.num_heads, "KDA heads")
        d, p = cfg.hidden_size, heads * k.head_dim
        self.layer_id = layer_id
        self.num_heads, self.head_dim, self.kernel = heads, k.head_dim, k.conv_kernel
        self.lower_bound = k.gate_lower_bound
        self.eps = cfg.rms_norm_eps
        self.scale = k.head_dim**-0.5
        self.q_proj, self.k_proj, self.v_proj = (empty_linear(d, p) for _ in range(3))
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            self.register_module(name, WeightVector(p, 1, k.conv_kernel))
        self.f_a_proj = empty_linear(d, k.head_dim)
        self.f_b_proj = empty_linear(k.head_dim, p)
        self.dt_bias = nn.Parameter(torch.zeros(p))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.b_proj = empty_linear(d, heads)
        if k.full_rank_gate:
            self.g_proj = empty_linear(d, p)
        else:
            self.g_a_proj = empty_linear(d, k.head_dim)
            self.g_b_proj = empty_linear(k.head_dim, p)
        self.o_norm = WeightVector(k.head_dim)
        self.o_proj = empty_linear(p, d)
        self._mark_shards()
        self.spec = KdaSpec(heads, k.head_dim, k.gate_lower_bound, cfg.rms_norm_eps, k.head_dim**-0.5)

    def _mark_shards(self) -> None:
        gate = self.g_proj if hasattr(self, "g_proj") else self.g_b_proj
        by_head = (self.q_proj, self.k_proj, self.v_proj, self.q_conv1d, self.k_conv1d, self.v_conv1d)
        for m in (*by_head, self.f_b_proj, self.b_proj, gate):
            shard(m.weight, 0)
        for param, dim in ((self.dt_bias, 0), (self.A_log, 0), (self.o_proj.weight, 1)):
            shard(param, dim)

    def conv_weight(self) -> torch.Tensor:
        """Fused depthwise weight [3P, W] over the concatenated (q, k, v) channels."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cache = ctx.cache
        if cache is not None and cache.decode_only:
            view = getattr(cache, "kda_slot_view", None)
            slot_view = None if view is None else view(self.layer_id)
            record = getattr(cache, "kda_record", None)  # a speculative verify's (ops/kda_record.py)
            record = None if record is None else record.layer(self.layer_id)
            y = self.ops.kda_decode(x, self.prepared, slot_view, lambda: self._attend(x, ctx), record)
        else:
            y = self._attend(x, ctx)
        return self.tp.all_reduce(y)

    def _attend(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """o_proj of the layer's attention op by op (`ops.kda_attend`), the cache updated; not reduced."""
        n = x.shape[0]
        cache = ctx.cache
        prior = cache.kda_state(self.layer_id) if cache is not None else None
        pre = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        f = self.f_b_proj(self.f_a_proj(x))
        beta = torch.sigmoid(self.b_proj(x).float())
        gate = self.output_gate(x).view(n, self.num_heads, self.head_dim)
        step = cache is not None and cache.decode_only and prior is not None
        offsets = cache.kda_export_offsets() if cache is not None and not step else None
        o, tail, state, exported = self._kda_op(pre, f, beta, gate, ctx.cu_seqlens, prior, offsets, step)
        if cache is not None:
            keep = getattr(cache, "keep_kda_inputs", None)
            if keep is not None:  # a speculative verify step folds the verified ones later (`replay`)
                keep(self.layer_id, pre, f, beta)
            cache.store_kda(self.layer_id, tail, state, exported)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))

    def replay(self, pre: torch.Tensor, f: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, prior):
        """(conv tails, states) after the tokens whose inputs `pre`, `f`, `beta` (as `_attend` made
        them) run from `prior` = (tails, states): the recurrence alone, no output kept. Speculative
        decoding folds only a verify step's accepted tokens into the live state this way."""
        gate = pre.new_zeros(pre.shape[0], self.num_heads, self.head_dim)
        _, tail, state, _ = self._kda_op(pre, f, beta, gate, cu_seqlens, prior, None, False)
        return tail, state

    def _kda_op(self, pre, f, beta, gate, cu_seqlens, prior, offsets, step):
        """`ops.kda_attend` with this layer's weights: (o, tails, states, exported)."""
        return self.ops.kda_attend(
            pre,
            f,
            beta,
            gate,
            self.conv_weight(),
            self.A_log,
            self.dt_bias,
            self.o_norm.weight,
            self.spec,
            cu_seqlens,
            prior,
            offsets,
            step,
            self.prepared,
        )


__all__ = ["KdaAttention"]
