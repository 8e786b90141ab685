"""Decoder layer and the two residual schemes: Block AttnRes (K3, spec §5) and plain pre-norm
residuals (Kimi-Linear, spec §4)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..parallel import SINGLE, ParallelContext, VocabParallelEmbedding
from .config import ModelConfig
from .context import ForwardContext
from .kda_layer import KdaAttention
from .mla_layer import DcpMlaAttention, MlaAttention
from .modules import OpsModule, RMSNorm, WeightVector, attn_res
from .moe_layer import GluMlp, MoeBlock


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext = SINGLE):
        super().__init__()
        d = cfg.hidden_size
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        mla_cls = DcpMlaAttention if tp.dcp_world > 1 else MlaAttention
        attn_cls = KdaAttention if cfg.layer_types[layer_id] == "kda" else mla_cls
        self.self_attn = attn_cls(cfg, layer_id, tp)
        if cfg.moe_layers[layer_id]:
            self.block_sparse_moe = MoeBlock(cfg, tp)
        else:
            self.mlp = GluMlp(cfg, d, cfg.intermediate_size, tp)
        if cfg.attn_res_block_size is not None:
            self.self_attention_res_proj = WeightVector(1, d)
            self.self_attention_res_norm = WeightVector(d)
            self.mlp_res_proj = WeightVector(1, d)
            self.mlp_res_norm = WeightVector(d)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def attention(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x), ctx)

    def forward_residual(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Kimi-Linear: h + Attn(norm(h)), then h + FFN(norm(h))."""
        h = h + self.attention(h, ctx)
        return h + self.ffn(self.post_attention_layernorm(h))

    def forward_attn_res(
        self, cur: torch.Tensor, bank: list[torch.Tensor], block_size: int, ctx: ForwardContext
    ) -> torch.Tensor:
        """K3 Block AttnRes step. `cur` is the running sum of the current block; `bank` (mutated)
        holds the finished blocks' sums. Banking happens after the attention-input mix; each mix
        and the norm after it are one op (`modules.attn_res(..., then=norm)`)."""
        a = self.self_attn(
            attn_res(cur, bank, self.self_attention_res_proj, self.self_attention_res_norm, self.input_layernorm), ctx
        )
        if self.layer_id % block_size == 0:
            bank.append(cur)
            cur = a
        else:
            cur = cur + a
        return cur + self.ffn(attn_res(cur, bank, self.mlp_res_proj, self.mlp_res_norm, self.post_attention_layernorm))


class DecoderStack(OpsModule):
    """`model.*`: embeddings (vocab-parallel under `tp`), layers, final norm (and K3's output
    AttnRes mix); every rank holds the full hidden states. `prepared`: the backend's whole-stack
    decode plan (`ops.decode_stack`: a decode step's layers in one call), or None; `step_context`:
    the context of the step that plan runs, for the layers it calls back."""

    step_context: ForwardContext | None = None

    def __init__(self, cfg: ModelConfig, tp: ParallelContext = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_proj = WeightVector(1, cfg.hidden_size)
            self.output_attn_res_norm = WeightVector(cfg.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [N, D] of the packed tokens."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if not self._whole_step(ctx):
            return self._layers(h, ctx)
        with self._stepping(ctx):
            return self.ops.decode_stack(h, self.prepared, ctx.cache, lambda: self._layers(h, ctx))

    def _layers(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The layers one by one over the input embeddings h, then the final norm."""
        block = self.cfg.attn_res_block_size
        if block is None:
            for layer in self.layers:
                h = layer.forward_residual(h, ctx)
        else:
            bank: list[torch.Tensor] = []
            for layer in self.layers:
                h = layer.forward_attn_res(h, bank, block, ctx)
            h = attn_res(h, bank, self.output_attn_res_proj, self.output_attn_res_norm)
        return self.norm(h)

    def decode_logits(self, input_ids: torch.Tensor, ctx: ForwardContext, head) -> torch.Tensor:
        """fp32 logits [N, vocab] of the step of `input_ids`: `head(forward(input_ids, ctx))`, in one
        backend call (`ops.decode_logits`: the embedding lookup, the layers and the output head) where
        the step is a decode step and the backend's plan holds them."""
        if not self._whole_step(ctx):
            return head(self.forward(input_ids, ctx))
        with self._stepping(ctx):
            return self.ops.decode_logits(
                input_ids, self.prepared, ctx.cache, lambda: head(self.forward(input_ids, ctx))
            )

    @staticmethod
    def _whole_step(ctx: ForwardContext) -> bool:
        """A decode step over a cache: one the backend may run as a whole (`ops.decode_stack`)."""
        return ctx.cache is not None and ctx.cache.decode_only

    @contextmanager
    def _stepping(self, ctx: ForwardContext):
        """`step_context` is `ctx` inside the block (the whole-stack plan's callbacks read it), then
        what it was before (the blocks nest where `decode_logits` falls back to `forward`)."""
        before, self.step_context = self.step_context, ctx
        try:
            yield
        finally:
            self.step_context = before
