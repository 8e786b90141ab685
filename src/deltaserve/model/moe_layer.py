"""FFN layers: the dense GLU MLP (layer 0, shared experts) and the MoE (spec/model.md §8-11)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.moe_a2a import gather_shares, share
from ..ops.mxfp4 import GROUP_SIZE as MXFP4_GROUP
from ..ops.operands import GluAct, RouteSpec
from ..parallel import SINGLE, ParallelContext, shard
from .config import ModelConfig
from .experts import StackedExperts
from .modules import OpsModule, RMSNorm, empty_linear


def glu_activation(cfg: ModelConfig) -> GluAct:
    """SiTU for K3 (every GLU site), SwiGLU for Kimi-Linear."""
    if cfg.hidden_act == "situ":
        return GluAct("situ", cfg.situ_beta or 0.0, cfg.situ_linear_beta)
    return GluAct("silu")


class GluMlp(OpsModule):
    """`down(act(gate(x), up(x)))`; names gate_proj / up_proj / down_proj. Under tensor
    parallelism the width is split (gate/up by rows, down by columns): the output is all-reduced
    when `reduce`, else left partial for the caller to reduce (the MoE's shared experts)."""

    def __init__(self, cfg: ModelConfig, hidden: int, width: int, tp: ParallelContext = SINGLE, reduce: bool = True):
        super().__init__()
        width = tp.split(width, "GLU width")
        self.tp, self.reduce = tp, reduce
        self.gate_proj = empty_linear(hidden, width)
        self.up_proj = empty_linear(hidden, width)
        self.down_proj = empty_linear(width, hidden)
        for param, dim in ((self.gate_proj.weight, 0), (self.up_proj.weight, 0), (self.down_proj.weight, 1)):
            shard(param, dim)
        self.act = glu_activation(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.glu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.act)
        return self.tp.all_reduce(y) if self.reduce else y


class Router(nn.Module):
    """`gate.weight [E, D]` and the fp32 `e_score_correction_bias [E]` (selection only)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.moe.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.moe.num_experts))


class MoeBlock(OpsModule):
    """K3 latent MoE: router and shared experts read x, the routed experts read
    z = routed_expert_down_proj(x); the weighted sum is normalised, then up-projected.
    Kimi-Linear: routed experts read x directly.

    Under tensor parallelism the router, the latent projections and their norm are replicated;
    routed and shared experts are split by their intermediate dim, so their sums are partial:
    the routed sum is all-reduced before the latent norm (where there is one), everything else
    once at the end.

    Under expert parallelism (`tp.expert_parallel`) routed experts are split by expert instead
    (`StackedExperts`), shared experts stay split by width. Attention is tensor-parallel, so every
    rank already holds every token's x and routes it identically: dispatch is free. Each rank runs
    only the (token, expert) pairs routed to its own experts (`ops.local_experts`) and the combine
    is the same all-reduce as above (before the latent norm); a reduce-scatter / all-to-all
    would only pay with data-parallel attention. The native whole-block plan does the same: the
    pairs of other ranks' experts skipped, its partial output reduced as above (by the backend with
    the layer's `reduce`, or by the whole-stack step before the latent norm).

    Under wide expert parallelism (`tp.ep_world` > 1, attention data-parallel) each replica routes
    only its own tokens: `StackedExperts` sends the pairs to their experts' ranks by all-to-all and
    back, so the routed sum is whole on return and never all-reduced. With TP > 1 inside the
    replica each TP rank routes and dispatches its `ops.moe_a2a.share` of the (replicated) rows and
    the replica all-gathers the routed sums (`gather_shares`; the module docstring of
    ops/moe_a2a.py says why); shared experts stay split by width and are reduced with the routed
    sum added once (`reduce_sum`). The block gets no native whole-block plan (it would skip the
    exchange)."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext = SINGLE):
        super().__init__()
        m = cfg.moe
        self.cfg = m
        self.tp = tp
        self.gate = Router(cfg)
        d_in = m.latent_size or cfg.hidden_size
        if m.latent_size is not None:
            self.routed_expert_down_proj = empty_linear(cfg.hidden_size, m.latent_size)
            self.routed_expert_up_proj = empty_linear(m.latent_size, cfg.hidden_size)
            if m.latent_norm:
                self.routed_expert_norm = RMSNorm(m.latent_size, cfg.rms_norm_eps)
        group = MXFP4_GROUP if cfg.quantization == "mxfp4" else 1
        self.experts = StackedExperts(m.num_experts, m.intermediate_size, d_in, tp, group)
        if m.num_shared_experts:
            width = m.num_shared_experts * m.intermediate_size
            self.shared_experts = GluMlp(cfg, cfg.hidden_size, width, tp, reduce=False)
        self.act = glu_activation(cfg)
        self.route_spec = RouteSpec(
            m.top_k, m.num_expert_group, m.topk_group, m.renormalize, m.routed_scaling_factor, m.bias_in_weights
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.moe_block(x, self.prepared, lambda: self._op_by_op(x), self.tp.all_reduce)

    def idle(self) -> None:
        """The routed experts on zero tokens (wide EP: this rank's empty part of the exchange)."""
        w = self.gate.weight
        k = self.route_spec.top_k
        z = w.new_zeros(0, self.experts.d_in)
        self.experts(z, torch.zeros(0, k, dtype=torch.long, device=w.device), w.new_zeros(0, k).float(), self.act)

    def _routed(self, x: torch.Tensor, latent: bool) -> torch.Tensor:
        """The routed experts' weighted sum of x's rows (in the latent space for K3)."""
        weights, ids, z = self.ops.route(
            x,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            self.route_spec,
            self.routed_expert_down_proj.weight if latent else None,
        )
        return self.experts(z, ids, weights, self.act)

    def _op_by_op(self, x: torch.Tensor) -> torch.Tensor:
        """The block op by op (route, experts, shared experts), reduced over the TP group."""
        tp, latent = self.tp, hasattr(self, "routed_expert_down_proj")
        whole = tp.ep_world > 1  # wide EP: the routed sum comes back whole, nothing to reduce
        if whole and tp.world > 1:
            n = x.shape[0]
            r = gather_shares(self._routed(x[share(n, tp.world, tp.rank)], latent), n, tp.world, tp.all_gather)
        else:
            r = self._routed(x, latent)
        shared = self.shared_experts(x) if hasattr(self, "shared_experts") else None
        if hasattr(self, "routed_expert_norm"):
            r = self.routed_expert_up_proj(self.routed_expert_norm(r if whole else tp.all_reduce(r)))
            return r if shared is None else tp.reduce_sum(shared, r)
        if latent:
            r = self.routed_expert_up_proj(r)
        if whole:
            return r if shared is None else tp.reduce_sum(shared, r)
        return tp.all_reduce(r if shared is None else r + shared)
