"""Kimi Delta Attention layer (spec/model.md §6) driven with or without a cache."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu import GATE_SIGMOID, GATE_SOFTPLUS, native
from ..kernels.cpu.blocks import KdaBlockWeights
from ..ops import kda as kda_ops
from ..ops.norms import gated_rms_norm
from .config import ModelConfig
from .context import ForwardContext
from .modules import WeightVector, cached_fp32, cached_object, empty_linear, project


class KdaAttention(nn.Module):
    """Parameters carry the checkpoint names. `A_log` is stored flat `[H]` (the loader strips
    K3's padding and Kimi-Linear's 4-D form); conv weights stay `[P, 1, W]` fp32."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        k = cfg.kda
        d, p = cfg.hidden_size, k.proj_dim
        self.layer_id = layer_id
        self.num_heads, self.head_dim, self.kernel = k.num_heads, k.head_dim, k.conv_kernel
        self.lower_bound = k.gate_lower_bound
        self.eps = cfg.rms_norm_eps
        self.scale = k.head_dim ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (empty_linear(d, p) for _ in range(3))
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            self.register_module(name, WeightVector(p, 1, k.conv_kernel))
        self.f_a_proj = empty_linear(d, k.head_dim)
        self.f_b_proj = empty_linear(k.head_dim, p)
        self.dt_bias = nn.Parameter(torch.zeros(p))
        self.A_log = nn.Parameter(torch.zeros(k.num_heads))
        self.b_proj = empty_linear(d, k.num_heads)
        if k.full_rank_gate:
            self.g_proj = empty_linear(d, p)
        else:
            self.g_a_proj = empty_linear(d, k.head_dim)
            self.g_b_proj = empty_linear(k.head_dim, p)
        self.o_norm = WeightVector(k.head_dim)
        self.o_proj = empty_linear(p, d)

    def conv_weight(self) -> torch.Tensor:
        """Fused depthwise weight [3P, W] over the concatenated (q, k, v) channels."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        if self.lower_bound is not None:
            return kda_ops.kda_gate_sigmoid(f, self.A_log, self.dt_bias, self.lower_bound)
        return kda_ops.kda_gate_softplus(f, self.A_log, self.dt_bias)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x)
        return self.g_b_proj(self.g_a_proj(x))

    def _native_decode(self, x: torch.Tensor, cache) -> torch.Tensor | None:
        """The fused decode step over the pool's own slots (`kernels.cpu` kda_decode), or None
        where it does not apply (no pool view, non-bf16 activations, another state dtype)."""
        view = getattr(cache, "kda_slot_view", None)
        kernels = native(x.device) if view is not None and x.dtype == torch.bfloat16 else None
        if kernels is None:
            return None
        tails, states, slots = view(self.layer_id)
        if tails.dtype != torch.bfloat16 or states.dtype != torch.float32:
            return None
        sigmoid_gate = self.lower_bound is not None
        plan = self._native_plan(kernels)
        if plan is not None and x.shape[0] <= kernels.kda_block_rows(plan):
            return kernels.kda_block(plan, x, tails, states, slots)
        f32 = self._f32_params()
        full_gate = hasattr(self, "g_proj")
        q, k, v, f_a, b, g = project(x, self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                                     self.g_proj if full_gate else self.g_a_proj)
        o = kernels.kda_decode(q, k, v, self._conv_weight_f32(), tails, states, slots, self.f_b_proj(f_a),
                               f32["A_log"], f32["dt_bias"], GATE_SIGMOID if sigmoid_gate else GATE_SOFTPLUS,
                               self.lower_bound if sigmoid_gate else 0.0, b,
                               g if full_gate else self.g_b_proj(g), f32["o_norm"], self.eps, self.scale)
        return self.o_proj(o)

    def _f32_params(self) -> dict[str, torch.Tensor]:
        """A_log, dt_bias and the output norm weight in fp32, memoised (the native decode kernels)."""
        return {name: cached_fp32(self, name, build, src) for name, build, src in (
            ("A_log", lambda: self.A_log, self.A_log), ("dt_bias", lambda: self.dt_bias, self.dt_bias),
            ("o_norm", lambda: self.o_norm.weight, self.o_norm.weight))}

    def _native_plan(self, kernels):
        """The whole decode step's plan (`kernels.cpu.blocks` kda_block: one native call instead of
        five, bit-identical to them), memoised until a weight changes; None where it does not apply."""

        def linears():
            full = hasattr(self, "g_proj")
            return (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.f_b_proj, self.b_proj,
                    self.g_proj if full else self.g_a_proj, None if full else self.g_b_proj, self.o_proj)

        def sources():
            return [*(m.weight for m in linears() if m is not None), self.q_conv1d.weight, self.k_conv1d.weight,
                    self.v_conv1d.weight, self.A_log, self.dt_bias, self.o_norm.weight]

        def build():
            f32 = self._f32_params()
            w = KdaBlockWeights(*(None if m is None else m.weight for m in linears()), conv_w=self._conv_weight_f32(),
                                a_log=f32["A_log"], dt_bias=f32["dt_bias"], norm_w=f32["o_norm"])
            sigmoid_gate = self.lower_bound is not None
            plan = kernels.kda_block_plan(w, self.num_heads, GATE_SIGMOID if sigmoid_gate else GATE_SOFTPLUS,
                                          self.lower_bound if sigmoid_gate else 0.0, self.eps, self.scale)
            return None if plan is None else (plan, w)   # w keeps the plan's tensors alive
        hit = cached_object(self, "native_block", build, sources)
        return None if hit is None else hit[0]

    def _conv_weight_f32(self) -> torch.Tensor:
        """The fused conv weight [3P, W] in fp32, memoised (the native decode and prefill kernels)."""
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        return cached_fp32(self, "conv", self.conv_weight, *convs)

    def _native_prefill(self, x: torch.Tensor, prior):
        """The kernels for the fused conv (+ q/k L2 norm) and chunked prefill (`kernels.cpu.kda`),
        or None (non-bf16 activations, no native build, a cached tail that is not bf16)."""
        if x.dtype != torch.bfloat16 or (prior is not None and prior[0].dtype != torch.bfloat16):
            return None
        return native(x.device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, h, dk = x.shape[0], self.num_heads, self.head_dim
        cache = ctx.cache
        if cache is not None and cache.decode_only:
            fast = self._native_decode(x, cache)
            if fast is not None:
                return fast
        prior = cache.kda_state(self.layer_id) if cache is not None else None
        pre = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        step = cache is not None and cache.decode_only and prior is not None
        kernels = self._native_prefill(x, prior) if not step else None
        if step:
            tail, state = prior
            mixed, tail = kda_ops.causal_conv1d_step(pre, self.conv_weight(), tail)
        elif kernels is not None:
            mixed, tail = kernels.causal_conv1d(pre, self._conv_weight_f32(), ctx.cu_seqlens,
                                                prior[0] if prior is not None else None, l2_groups=2 * h, group=dk)
            state = prior[1] if prior is not None else None
        else:
            mixed, tail = kda_ops.causal_conv1d(pre, self.conv_weight(), ctx.cu_seqlens,
                                                prior[0] if prior is not None else None)
            state = prior[1] if prior is not None else None
        q, k, v = mixed.view(n, 3, h, dk).unbind(1)
        if kernels is None:                        # the native conv already normalised q and k
            q, k = kda_ops.l2_norm(q), kda_ops.l2_norm(k)
        f = self.f_b_proj(self.f_a_proj(x)).view(n, h, dk)
        if kernels is not None and self.lower_bound is not None:
            f32 = self._f32_params()
            g = kernels.kda_gate_sigmoid(f, f32["A_log"], f32["dt_bias"], self.lower_bound)
        else:
            g = self.decay(f)
        beta = torch.sigmoid(self.b_proj(x).float())
        exported = None
        if step:
            o = kda_ops.kda_recurrent_step(q, k, v, g, beta, state, self.scale)
        else:
            offsets = cache.kda_export_offsets() if cache is not None else None
            chunked = kernels.kda_chunked if kernels is not None else kda_ops.kda_chunked
            o, state, states_at = chunked(q, k, v, g, beta, ctx.cu_seqlens, self.scale,
                                          initial_state=state, export_offsets=offsets)
            if offsets is not None:
                tails_at = kda_ops.conv_tails_at(pre, ctx.cu_seqlens, prior[0] if prior is not None else None,
                                                 offsets, self.kernel)
                exported = (tails_at, states_at)
        if cache is not None:
            cache.store_kda(self.layer_id, tail, state, exported)
        gate = self.output_gate(x).view(n, h, dk)
        if kernels is not None and gate.dtype == torch.bfloat16:
            o = kernels.gated_rms_norm(o, self._f32_params()["o_norm"], gate, self.eps)
        else:
            o = gated_rms_norm(o, self.o_norm.weight, gate, self.eps, x.dtype)
        return self.o_proj(o.reshape(n, h * dk))


__all__ = ["KdaAttention"]
