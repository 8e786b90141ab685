"""`KimiForCausalLM`: the text model of both families."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .context import ForwardContext
from .decoder import DecoderStack
from .modules import empty_linear


class KimiForCausalLM(nn.Module):
    """Parameter names equal the checkpoint's text names (`model.…`, `lm_head.weight`), with
    routed experts stacked per layer (`…experts.w1 [E, I, Din]`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = empty_linear(cfg.hidden_size, cfg.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final-normed hidden states [N, D] for packed `input_ids` [N]."""
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (no soft-cap, no scale: spec §2)."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one whole sequence with no cache: the reference path."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError("forward_full takes a non-empty 1-D tensor of token ids")
        ids = input_ids.to(self.device)
        return self.compute_logits(self.forward(ids, ForwardContext.single(ids.numel(), ids.device)))
