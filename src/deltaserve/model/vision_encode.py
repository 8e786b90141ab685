"""`TowerJob`: one image through the vision model in pieces, so an engine can spread a large
image's encode over several steps (engine/exec/encoder_cache.py).

Invariants:
- A job is the image's tower, block by block; within a block, rows in order. Every block first
  forms the whole image's q, k, v (row-wise, linear), then takes rows in chunks
  (`VisionBlock.rows`), writing the block's output for those rows; the block's input is replaced
  only when all its rows are done. Merge and projector run once, after the last block.
- `advance(units)` does at most `units` (row, block) pairs (at least one chunk, so it always
  progresses) and returns how many it did; a whole job costs `patches * num_layers` units.
- Chunks hold at most `chunk_rows` rows, so the memory a job holds is linear in its patches:
  its block input and output, q, k, v and cos/sin (`state_bytes`), plus one chunk's activations
  and the bounded attention scores (`ops.vision.SCORE_BYTES`).
- The rows equal `VisionModel.forward` on the image alone (same ops, same order within a row),
  up to the reduction order of the linears on a different number of rows.
"""

from __future__ import annotations

import torch

from ..ops import vision as vops
from .vision import VisionModel

DEFAULT_CHUNK_ROWS = 1024  # rows per block call


class TowerJob:
    def __init__(self, vision: VisionModel, patches: torch.Tensor, grid_thw, chunk_rows: int = DEFAULT_CHUNK_ROWS):
        (self.grid,) = vision.check_grids(patches, [grid_thw])
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        self.vision, self.patches, self.chunk_rows = vision, patches, chunk_rows
        self.num_patches = patches.shape[0]
        self.layer, self.row = 0, 0
        self.x: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self._qkv: tuple[torch.Tensor, ...] | None = None
        self._next: torch.Tensor | None = None
        self.result: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def units_left(self) -> int:
        layers = self.vision.cfg.num_layers
        return 0 if self.done else (layers - self.layer) * self.num_patches - self.row

    @torch.inference_mode()
    def advance(self, units: int) -> int:
        """Run up to `units` (row, block) pairs (at least one chunk); returns the number run."""
        tower = self.vision.vision_tower
        if self.x is None:
            self._start(tower)
        spent = 0
        while not self.done and (spent == 0 or spent < units):
            block = tower.encoder.blocks[self.layer]
            if self._qkv is None:
                self._qkv = block.qkv(self.x, self.cos, self.sin)
                self._next = torch.empty_like(self.x)
            q, k, v = self._qkv
            n = min(self.chunk_rows, self.num_patches - self.row, max(1, units - spent))
            a, b = self.row, self.row + n
            self._next[a:b] = block.rows(self.x[a:b], q[a:b], k, v)
            self.row, spent = b, spent + n
            if self.row == self.num_patches:
                self.x, self._next, self._qkv = self._next, None, None
                self.layer, self.row = self.layer + 1, 0
                if self.layer == self.vision.cfg.num_layers:
                    self._finish(tower)
        return spent

    def _start(self, tower) -> None:
        _, h, w = self.grid
        weight = self.vision.mm_projector.post_norm.weight
        patches = self.patches.to(weight.device, weight.dtype)  # on the device only once it starts
        self.x = tower.patch_embed(patches, [(h, w)])
        rows, cols = vops.grid_positions([(h, w)], self.x.device)
        self.cos, self.sin = vops.rope2d_cos_sin(rows, cols, self.vision.cfg.head_dim, self.vision.cfg.rope_theta)
        self.patches = None  # the pixels are not needed again

    def _finish(self, tower) -> None:
        states = tower.encoder.final_layernorm(self.x)
        self.result = self.vision.mm_projector(self.vision.merge(states, [self.grid]))
        self.x = self.cos = self.sin = None


def state_bytes(vision: VisionModel, patches: int) -> int:
    """Bytes a job over `patches` rows holds between chunks (model dtype; cos/sin fp32): block
    input and output, q, k, v, cos and sin."""
    cfg = vision.cfg
    size = vision.mm_projector.post_norm.weight.element_size()
    return patches * (size * (2 * cfg.hidden_size + 3 * cfg.qkv_size) + 4 * cfg.head_dim)
