"""FFN layers: the dense GLU MLP (layer 0, shared experts) and the MoE (spec/model.md §8-11)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from ..kernels.cpu import ACT_SILU, ACT_SITU, AMX_ROWS, MAX_ROWS, native
from ..kernels.cpu.blocks import MoeBlockWeights
from ..ops.activations import silu_and_mul, situ_and_mul
from ..ops.moe import route
from .config import ModelConfig
from .experts import FUSED_MAX_TOKENS, StackedExperts
from .modules import RMSNorm, cached_object, empty_linear, project


def glu_activation(cfg: ModelConfig):
    """SiTU for K3 (every GLU site), SwiGLU for Kimi-Linear."""
    if cfg.hidden_act == "situ":
        return functools.partial(situ_and_mul, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    return silu_and_mul


@functools.lru_cache(maxsize=AMX_ROWS)
def _single_expert_routing(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) routing each of n tokens to expert 0 with weight 1 (read-only constants)."""
    return torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.float32)


class GluMlp(nn.Module):
    """`down(act(gate(x), up(x)))`; names gate_proj / up_proj / down_proj."""

    def __init__(self, cfg: ModelConfig, hidden: int, width: int):
        super().__init__()
        self.gate_proj = empty_linear(hidden, width)
        self.up_proj = empty_linear(hidden, width)
        self.down_proj = empty_linear(width, hidden)
        self.act = glu_activation(cfg)
        self.act_spec = (ACT_SITU if cfg.hidden_act == "situ" else ACT_SILU, cfg.situ_beta or 0.0,
                         cfg.situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 on CPU: up to MAX_ROWS tokens (AMX_ROWS with AMX tiles) run as one fused call (the
        MoE kernel with a single expert of weight 1, which rounds exactly as this module's three
        linears and activation); more tokens run the linears as GEMMs (one dense weight is better
        read by a GEMM than in row chunks) with the native GLU between them."""
        n = x.shape[0]
        kernels = native(x.device) if x.dtype == torch.bfloat16 and x.dim() == 2 and n > 0 else None
        ws = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if kernels is None or not all(w.dtype == torch.bfloat16 for w in ws):
            return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
        if n <= (AMX_ROWS if kernels.amx else MAX_ROWS):
            return kernels.moe_experts(x, *_single_expert_routing(n), *(w.unsqueeze(0) for w in ws), *self.act_spec)
        return self.down_proj(kernels.glu_rows(self.gate_proj(x), self.up_proj(x), *self.act_spec))


class Router(nn.Module):
    """`gate.weight [E, D]` and the fp32 `e_score_correction_bias [E]` (selection only)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.moe.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.moe.num_experts))


class MoeBlock(nn.Module):
    """K3 latent MoE: router and shared experts read x, the routed experts read
    z = routed_expert_down_proj(x); the weighted sum is normalised, then up-projected.
    Kimi-Linear: routed experts read x directly."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.cfg = m
        self.gate = Router(cfg)
        d_in = m.latent_size or cfg.hidden_size
        if m.latent_size is not None:
            self.routed_expert_down_proj = empty_linear(cfg.hidden_size, m.latent_size)
            self.routed_expert_up_proj = empty_linear(m.latent_size, cfg.hidden_size)
            if m.latent_norm:
                self.routed_expert_norm = RMSNorm(m.latent_size, cfg.rms_norm_eps)
        self.experts = StackedExperts(m.num_experts, m.intermediate_size, d_in, cfg.hidden_act,
                                      cfg.situ_beta, cfg.situ_linear_beta)
        if m.num_shared_experts:
            self.shared_experts = GluMlp(cfg, cfg.hidden_size, m.num_shared_experts * m.intermediate_size)
        self.act = glu_activation(cfg)

    def _route_and_down(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, ids) of `ops.moe.route` and the routed experts' input z. Small bf16 batches on
        CPU compute the fp32 router logits and z in one native pass over both weights and select
        with the native kernel (one call instead of ~25 torch ops)."""
        m, gate = self.cfg, self.gate
        args = (m.top_k, m.num_expert_group, m.topk_group, m.renormalize, m.routed_scaling_factor,
                m.bias_in_weights)
        latent = hasattr(self, "routed_expert_down_proj")
        kernels = native(x.device) if x.dtype == torch.bfloat16 and 0 < x.shape[0] <= FUSED_MAX_TOKENS else None
        if kernels is not None:
            layers = (gate, self.routed_expert_down_proj) if latent else (gate,)
            outs = project(x, *layers, f32=(True, False)[:len(layers)])
            picked = kernels.route(outs[0], gate.e_score_correction_bias, *args)
            if picked is not None:
                return *picked, outs[-1] if latent else x
        weights, ids = route(x, gate.weight, gate.e_score_correction_bias, *args)
        return weights, ids, self.routed_expert_down_proj(x) if latent else x

    def _native_plan(self, kernels):
        """The `kernels.cpu.blocks` plan of this block (None where it does not apply), memoised
        until a weight changes. Bit-identical to the per-module path below, which it replaces for
        decode-sized bf16 batches (~8 native calls and their Python in one call)."""
        m, ex = self.cfg, self.experts
        latent = hasattr(self, "routed_expert_down_proj")
        norm = getattr(self, "routed_expert_norm", None)
        shared = getattr(self, "shared_experts", None)

        def sources():
            flat = [t for o in ex._fused_operands() for t in (o if isinstance(o, tuple) else (o,))]
            out = [self.gate.weight, self.gate.e_score_correction_bias, *flat]
            if latent:
                out += [self.routed_expert_down_proj.weight, self.routed_expert_up_proj.weight]
            if norm is not None:
                out.append(norm.weight)
            if shared is not None:
                out += [shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight]
            return out

        def build():
            operands = ex._fused_operands()
            act = (ex.act_kind, ex.beta or 0.0, ex.linear_beta)
            if shared is not None and shared.act_spec != act:
                return None
            w = MoeBlockWeights(
                gate=self.gate.weight, bias=self.gate.e_score_correction_bias.float().contiguous(), experts=operands,
                down=self.routed_expert_down_proj.weight if latent else None,
                up=self.routed_expert_up_proj.weight if latent else None,
                norm_w=norm.weight_f32() if norm is not None else None,
                shared=None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight,
                                                    shared.down_proj.weight))
            route_args = (m.top_k, m.num_expert_group, m.topk_group, m.renormalize, m.routed_scaling_factor,
                          m.bias_in_weights)
            plan = kernels.moe_block_plan(w, route_args, act, norm.eps if norm is not None else 0.0)
            return None if plan is None else (plan, w)   # w keeps the plan's tensors alive
        hit = cached_object(self, "native_block", build, sources)
        return None if hit is None else hit[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = native(x.device) if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] > 0 else None
        plan = self._native_plan(kernels) if kernels is not None else None
        if plan is not None and x.shape[0] <= kernels.moe_block_rows(plan):
            out = kernels.moe_block(plan, x)
            if out is not None:
                return out
        weights, ids, z = self._route_and_down(x)
        latent = hasattr(self, "routed_expert_down_proj")
        r = self.experts(z, ids, weights, self.act)
        if latent:
            if hasattr(self, "routed_expert_norm"):
                r = self.routed_expert_norm(r)
            r = self.routed_expert_up_proj(r)
        if hasattr(self, "shared_experts"):
            r = r + self.shared_experts(x)
        return r
