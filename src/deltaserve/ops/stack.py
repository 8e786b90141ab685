"""What a backend's whole-stack decode step (`TorchOps.prepare_stack` / `decode_stack`) is built
from: each decoder layer's prepared operands, in the order `model.decoder.DecoderStack` runs them.

`model.fused.prepare_model` fills these from the modules after every module is prepared, only
where every layer has its decode plans (or, decode-context-parallel MLA, a callback to its module;
under tensor and expert parallelism each rank's shards, with the rank's `reduce`); the backend may
still decline it and run the modules one by one (the `otherwise` of `decode_stack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.context import Reduce
from .operands import GluAct


@dataclass
class NormOperands:
    """An RMSNorm site: its backend-prepared weight and eps."""

    prepared: object
    eps: float


@dataclass
class StackLayerOperands:
    """One decoder layer: attention (its prepared KDA or MLA operands; an MLA layer also its output
    projection, None for KDA; or a callable the step calls back: normed input -> the layer's attention
    output, summed over the ranks), the FFN (the MoE block's prepared operands, or the dense GLU's three
    weights), the AttnRes queries before each sublayer (None: pre-norm residuals) and the two norms."""

    attn: object
    o_proj: torch.Tensor | None
    moe: object | None
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    act: GluAct
    attn_mix: object | None
    mlp_mix: object | None
    attn_norm: NormOperands
    mlp_norm: NormOperands


@dataclass
class StackOperands:
    """The decoder stack: its layers, Block AttnRes' block size (None: pre-norm residuals), the
    output mix's query and the final norm; `head`, the (embedding, lm_head) weights around it (None:
    a stack without its model's output head); `reduce`, a tensor-parallel rank's sum over the ranks
    ((partial, replicated or None) -> sum; None: unsharded), called where a layer's output is partial."""

    hidden: int
    layers: list[StackLayerOperands]
    block_size: int | None
    out_mix: object | None
    final_norm: NormOperands
    head: tuple[torch.Tensor, torch.Tensor] | None = None
    reduce: Reduce | None = None
