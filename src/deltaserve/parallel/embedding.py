"""The vocab-parallel token embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .context import ParallelContext, shard


class VocabParallelEmbedding(nn.Embedding):
    """`nn.Embedding` whose rows are split by vocab: rank r holds ids [r*V/W, (r+1)*V/W); each
    rank looks up the ids it holds (zeros elsewhere) and the sum over ranks is the embedding.
    With world 1 it is the plain lookup."""

    def __init__(self, vocab: int, dim: int, tp: ParallelContext):
        super().__init__(tp.split(vocab, "vocab_size"), dim)
        shard(self.weight, 0)
        self.tp = tp
        self.start = tp.rank * self.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(h)
