"""Routed-expert weights of one MoE layer, dense or MXFP4-packed.

Dense: `w1` (gate), `w3` (up) `[E, I, Din]` and `w2` `[E, Din, I]` parameters. Packed
(`--moe-weights packed`, the default for MXFP4 checkpoints in bf16): the checkpoint's `weight_packed`
`[E, O, I/2]` and `weight_scale` `[E, O, I/32]` uint8 tensors kept as they are, about 4.25 bits
per weight; each GEMM decodes its expert on the fly (exactly, so both modes compute the same
products). Execution is the backend's `experts` op (`ops.backends.torch.TorchOps.experts`), or
`local_experts` on a rank holding a slice of the experts, or under wide expert parallelism
(`tp.ep_world` > 1) `ops.moe_a2a.a2a_experts`: tokens exchanged with the ranks holding their
experts, the tokens each local expert received counted in `expert_load`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.moe_a2a import a2a_experts
from ..ops.operands import ExpertWeights, GluAct
from ..parallel import SINGLE, ParallelContext, shard
from .modules import OpsModule

PROJECTIONS = ("w1", "w3", "w2")


def rank_width(width: int, tp: ParallelContext, group: int) -> tuple[int, bool]:
    """(each rank's share of the intermediate `width`, whether it is zero-padded): `width` / W
    where that is whole `group`s, else ceil(width / (group W)) groups (padded)."""
    if tp.world == 1 or (width % tp.world == 0 and (width // tp.world) % group == 0):
        return tp.split(width, "expert width"), False
    if group == 1:
        return tp.split(width, "expert width"), False  # raises: the width does not divide
    return -(-width // (group * tp.world)) * group, True


class StackedExperts(OpsModule):
    """The routed experts of a layer this rank holds. The loader fills either the dense parameters
    or, through `set_packed`, the packed buffers `{w1,w3,w2}_packed` / `_scale` (validated MXFP4).

    `num_experts` and `width` are the model's; `tp` decides the split (world W > 1). Tensor
    parallel: every expert, w1/w3 split by rows and w2 by columns (`width` / W each). With `group`
    (32 for MXFP4 checkpoints) each rank's width is whole groups: where `width` / W is not, every
    rank holds ceil(width / (group W)) groups, the columns past `width` zero (`tp_padded`; the
    loader pads them), which is exact for a GLU whose activation maps 0 to 0 (SiTU, SwiGLU: the
    zero gate and up rows give 0, the zero down columns add 0). Expert parallel
    (`tp.expert_parallel`, or wide: `tp.ep_world` > 1): the contiguous experts [first, first + E/W)
    whole, W = `tp.expert_world`, split along the expert dim; E % W must be 0. The output is this
    rank's partial sum of the routed output under TP (the full output at W = 1, and under wide EP,
    where every token's pairs travel to their experts and back)."""

    def __init__(self, num_experts: int, width: int, d_in: int, tp: ParallelContext = SINGLE, group: int = 1):
        super().__init__()
        world = tp.expert_world
        by_expert = world > 1
        if by_expert and num_experts % world:
            raise ValueError(f"expert parallelism: {num_experts} routed experts do not split evenly over {world} ranks")
        local = num_experts // world if by_expert else num_experts
        padded = False
        if not by_expert:
            width, padded = rank_width(width, tp, group)
        self.w1 = nn.Parameter(torch.zeros(local, width, d_in))
        self.w3 = nn.Parameter(torch.zeros(local, width, d_in))
        self.w2 = nn.Parameter(torch.zeros(local, d_in, width))
        for param, dim in zip((self.w1, self.w3, self.w2), (0, 0, 0) if by_expert else (1, 1, 2)):
            shard(param, dim)
            param.tp_padded = padded
        self.num_experts, self.width, self.d_in = local, width, d_in
        self.total, self.first = num_experts, tp.expert_rank * local if by_expert else 0
        self.tp = tp
        self.expert_load: torch.Tensor | None = None  # wide EP: tokens each local expert ran, once any did
        self.packed = False
        self.compute_dtype = None

    @property
    def sliced(self) -> bool:
        """True where this rank holds only some of the experts (expert parallelism)."""
        return self.num_experts != self.total

    def set_packed(self, proj: str, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        """Replace dense `proj` by its packed form; activations run in `dtype`."""
        delattr(self, proj)
        self.register_buffer(f"{proj}_packed", packed)
        self.register_buffer(f"{proj}_scale", scale)
        self.packed, self.compute_dtype = True, dtype

    def weights(self) -> ExpertWeights:
        """The experts as the backend's `experts` op takes them (the tensors themselves, no copy)."""
        if not self.packed:
            return ExpertWeights(self.w1, self.w3, self.w2)
        return ExpertWeights(
            *((getattr(self, f"{p}_packed"), getattr(self, f"{p}_scale")) for p in PROJECTIONS),
            dtype=self.compute_dtype,
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: GluAct) -> torch.Tensor:
        """`ops.moe.grouped_experts` semantics over the experts held: x [N, Din] -> [N, Din] in x's
        dtype; `ids` are the router's (global) expert ids."""
        if self.tp.ep_world > 1:
            return self._exchanged(x, ids, weights, act)
        if self.sliced:
            return self.ops.local_experts(x, ids, weights, self.weights(), act, self.first)
        return self.ops.experts(x, ids, weights, self.weights(), act)

    def _exchanged(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: GluAct) -> torch.Tensor:
        """Wide EP: the pairs sent to the ranks of their experts, run there, sent back and summed."""
        ex = self.weights()

        def run_local(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
            ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=rows.device)
            return self.ops.experts(rows, local[:, None].to(rows.device), ones, ex, act)

        out, load = a2a_experts(x, ids, weights, self.total, self.tp.ep_world, self.tp.ep_all_to_all, run_local)
        if self.expert_load is None:
            self.expert_load = torch.zeros(self.num_experts, dtype=torch.long)
        self.expert_load += load.cpu()
        return out


def expert_load(model: object) -> dict | None:
    """Wide EP: tokens each of this rank's routed experts ran, summed over the MoE layers since
    load, as {"first": its first expert's id, "tokens": [count per local expert]}; None where no
    expert exchange ran (not wide EP, or no step yet)."""
    modules = model.modules() if isinstance(model, nn.Module) else ()
    held = [m for m in modules if isinstance(m, StackedExperts) and m.expert_load is not None]
    if not held:
        return None
    return {"first": held[0].first, "tokens": torch.stack([m.expert_load for m in held]).sum(0).tolist()}
