"""`prepare_model`: bind a model to its op backend and build, once, what the backend derives
from the weights (fp32 copies of small tensors, absorbed MLA weights, whole-block decode plans,
the whole-stack decode plan), the way vLLM processes weights after loading.

Invariant: a model's forward reads only what the last `prepare_model` built. Call it again after
any change to the weights (a reload, an in-place edit): the plans hold raw pointers into the
weight tensors and the fp32 copies are snapshots.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..ops.backends.select import select_ops
from ..ops.backends.torch import TorchOps
from ..ops.operands import KdaWeights, MlaWeights, MoeWeights
from ..ops.stack import NormOperands, StackLayerOperands, StackOperands
from .decoder import DecoderLayer, DecoderStack
from .kda_layer import KdaAttention
from .mla_layer import DcpMlaAttention, MlaAttention
from .modules import OpsModule, RMSNorm, WeightVector
from .moe_layer import GluMlp, MoeBlock

_ATTN_RES_PAIRS = (
    ("self_attention_res_proj", "self_attention_res_norm"),
    ("mlp_res_proj", "mlp_res_norm"),
    ("output_attn_res_proj", "output_attn_res_norm"),
)


def _model_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and compute dtype of `model` (its output head's, else its first floating tensor's)."""
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head.weight.device, head.weight.dtype
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            return t.device, t.dtype
    return torch.device("cpu"), torch.float32


def _kda(m: KdaAttention, ops: TorchOps):
    full = hasattr(m, "g_proj")
    w = KdaWeights(
        m.q_proj.weight,
        m.k_proj.weight,
        m.v_proj.weight,
        m.f_a_proj.weight,
        m.f_b_proj.weight,
        m.b_proj.weight,
        (m.g_proj if full else m.g_a_proj).weight,
        None if full else m.g_b_proj.weight,
        m.o_proj.weight,
        conv=m.conv_weight(),
        a_log=m.A_log,
        dt_bias=m.dt_bias,
        norm=m.o_norm.weight,
    )
    return ops.prepare_kda(w, m.spec)


def _mla(m: MlaAttention, ops: TorchOps):
    low_rank = hasattr(m, "q_a_proj")
    w = MlaWeights(
        (m.q_a_proj if low_rank else m.q_proj).weight,
        m.q_b_proj.weight if low_rank else None,
        m.q_a_layernorm.weight if low_rank else None,
        m.kv_a_proj_with_mqa.weight,
        m.kv_a_layernorm.weight,
        m.g_proj.weight if hasattr(m, "g_proj") else None,
        *m.kv_b_split(),
        heads=m.num_heads,
        nope=m.nope,
        rope=m.rope,
        q_eps=m.q_a_layernorm.eps if low_rank else 0.0,
        kv_eps=m.kv_a_layernorm.eps,
        scale=m.scale,
    )
    return ops.prepare_mla(w)


def _moe(m: MoeBlock, ops: TorchOps):
    ops.prepare_experts(m.experts.weights(), m.act)
    if m.tp.ep_world > 1:  # wide EP: the routed pairs travel by all-to-all, which no native plan does
        return None
    latent = hasattr(m, "routed_expert_down_proj")
    norm = getattr(m, "routed_expert_norm", None)
    shared = getattr(m, "shared_experts", None)
    w = MoeWeights(
        m.gate.weight,
        m.gate.e_score_correction_bias,
        m.experts.weights(),
        m.act,
        m.route_spec,
        down=m.routed_expert_down_proj.weight if latent else None,
        up=m.routed_expert_up_proj.weight if latent else None,
        norm=None if norm is None else norm.weight,
        norm_eps=0.0 if norm is None else norm.eps,
        shared=None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight),
        shared_act=None if shared is None else shared.act,
        partial=m.tp.world > 1,
        first=m.experts.first,
    )
    return ops.prepare_moe(w)


def _attn_res(owner: nn.Module, ops: TorchOps) -> None:
    """The mix operand of each AttnRes site, kept on its projection (`modules.attn_res` reads it)."""
    for proj_name, norm_name in _ATTN_RES_PAIRS:
        proj: WeightVector | None = getattr(owner, proj_name, None)
        if proj is not None:
            proj.prepared = ops.prepare_attn_res(proj.weight, getattr(owner, norm_name).weight)


def _norm(m: RMSNorm) -> NormOperands:
    return NormOperands(m.prepared, m.eps)


def _attend(stack: DecoderStack, attn: DcpMlaAttention):
    """A decode-context-parallel MLA layer as the whole-stack step calls it back: the module on the
    step's context (its gathers, partial attention and all-reduce in Python)."""
    return lambda x: attn(x, stack.step_context)


def _stack(stack: DecoderStack, lm_head: torch.Tensor | None) -> StackOperands | None:
    """The whole-stack decode operands of `stack` (with its model's `lm_head` weight, if any): None
    where a layer lacks a prepared attention or MoE plan (a decode-context-parallel MLA layer, which
    has none, is called back: `_attend`). Under tensor (and expert) parallelism the rank's shards, its
    `reduce` and no output head (the vocabulary is split: the model embeds and gathers the logits)."""
    attn_res = stack.cfg.attn_res_block_size is not None
    tp = stack.layers[0].self_attn.tp
    layers = []
    for layer in stack.layers:
        attn = layer.self_attn
        moe: MoeBlock | None = getattr(layer, "block_sparse_moe", None)
        mlp: GluMlp | None = getattr(layer, "mlp", None)
        if (attn.prepared is None and not isinstance(attn, DcpMlaAttention)) or (
            moe is not None and moe.prepared is None
        ):
            return None
        layers.append(
            StackLayerOperands(
                _attend(stack, attn) if attn.prepared is None else attn.prepared,
                attn.o_proj.weight if isinstance(attn, MlaAttention) else None,
                None if moe is None else moe.prepared,
                None if mlp is None else (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight),
                (moe if moe is not None else mlp).act,
                layer.self_attention_res_proj.prepared if attn_res else None,
                layer.mlp_res_proj.prepared if attn_res else None,
                _norm(layer.input_layernorm),
                _norm(layer.post_attention_layernorm),
            )
        )
    out_mix = stack.output_attn_res_proj.prepared if attn_res else None
    if tp.world > 1:
        return StackOperands(
            stack.cfg.hidden_size, layers, stack.cfg.attn_res_block_size, out_mix, _norm(stack.norm), None, tp.sum
        )
    head = None if lm_head is None else (stack.embed_tokens.weight, lm_head)
    return StackOperands(stack.cfg.hidden_size, layers, stack.cfg.attn_res_block_size, out_mix, _norm(stack.norm), head)


@torch.no_grad()
def prepare_model(model: nn.Module, ops: TorchOps | None = None, fuse_blocks: bool = True) -> TorchOps:
    """Bind every `OpsModule` of `model` to `ops` (default: `select_ops` for the model's device and
    dtype) and build their prepared operands; returns the backend (also kept as `model.ops`)."""
    if ops is None:
        ops = select_ops(*_model_dtype(model), fuse_blocks=fuse_blocks)
    for m in model.modules():
        if isinstance(m, OpsModule):
            m.ops, m.prepared = ops, None
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.prepared = ops.prepare_norm(m.weight)
        elif isinstance(m, (DecoderLayer, DecoderStack)):
            _attn_res(m, ops)
    for m in model.modules():
        if isinstance(m, KdaAttention):
            m.prepared = _kda(m, ops)
        elif isinstance(m, MlaAttention):
            m.prepared = _mla(m, ops) if m.native_kernels else None
        elif isinstance(m, MoeBlock):
            m.prepared = _moe(m, ops)
    for m in model.modules():
        if isinstance(m, DecoderStack):
            head = getattr(model, "lm_head", None)
            operands = _stack(m, None if head is None else head.weight)
            m.prepared = None if operands is None else ops.prepare_stack(operands)
    model.ops = ops
    return ops


@contextmanager
def bound_ops(model: nn.Module, ops: TorchOps):
    """Run `model` on `ops` inside the block (e.g. the reference, to compare against), then
    prepare it again for the backend it had."""
    old = getattr(model, "ops", None)
    prepare_model(model, ops)
    try:
        yield model
    finally:
        prepare_model(model, old)
