"""`KimiForCausalLM`: the text model of both families."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import SINGLE, ParallelContext, shard
from .config import ModelConfig
from .context import ForwardContext
from .decoder import DecoderStack
from .kda_layer import KdaAttention
from .modules import empty_linear


class KimiForCausalLM(nn.Module):
    """Parameter names equal the checkpoint's text names (`model.…`, `lm_head.weight`), with
    routed experts stacked per layer (`…experts.w1 [E, I, Din]`). Built with a tensor-parallel
    context `tp`, the parameters are this rank's shards (`parallel.context`), the lm_head split
    by vocab rows; the logits are gathered, so every rank returns the full logits."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or SINGLE
        self.model = DecoderStack(cfg, tp)
        self.lm_head = empty_linear(cfg.hidden_size, tp.split(cfg.vocab_size, "vocab_size"))
        shard(self.lm_head.weight, 0)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: ForwardContext,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [N, D] for packed `input_ids` [N]. `embeds` = (index [M]
        long, rows [M, D]) replaces the input embedding of packed positions `index` with `rows`
        (image projector rows at `<|media_pad|>` positions, spec §12.6); under tensor parallelism
        after the vocab-parallel lookup's all-reduce, so every rank must pass the same rows."""
        if embeds is None:
            return self.model(input_ids, ctx)
        index, rows = embeds
        h = self.model.embed_tokens(input_ids)
        h = h.index_copy(0, index.to(h.device, non_blocking=True), rows.to(device=h.device, dtype=h.dtype))
        return self.model(input_ids, ctx, inputs_embeds=h)

    def decode_logits(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """`compute_logits(forward(input_ids, ctx))`: of a decode step in one backend call where the
        backend has one (the same values)."""
        return self.model.decode_logits(input_ids, ctx, self.compute_logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (no soft-cap, no scale: spec §2)."""
        return self.tp.all_gather(self.lm_head(hidden)).float()

    @torch.inference_mode()
    def fold_kda(self, cache) -> None:
        """Fold the verified tokens of a speculative verify step into the live KDA states: per KDA
        layer, `cache.fold_inputs(layer)` -> (pre, f, beta, cu_seqlens, prior) of the verified
        tokens only, replayed from the pre-verify state, then `cache.fold_store(layer, tails, states)`."""
        for layer in self.model.layers:
            attn = layer.self_attn
            if isinstance(attn, KdaAttention):
                pre, f, beta, cu, prior = cache.fold_inputs(attn.layer_id)
                cache.fold_store(attn.layer_id, *attn.replay(pre, f, beta, cu, prior))

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """A forward of zero tokens for a wide-EP rank with no work (`tp.ep_world` > 1): every MoE
        layer's expert exchange in layer order, its share empty. Attention is data-parallel there,
        so these exchanges are all the collectives a step has: the ranks that do compute go on."""
        for layer in self.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None:
                moe.idle()

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one whole sequence with no cache: the reference path."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError("forward_full takes a non-empty 1-D tensor of token ids")
        ids = input_ids.to(self.device)
        return self.compute_logits(self.forward(ids, ForwardContext.single(ids.numel(), ids.device)))
