"""The operand bundles of the op seam (`ops.backends.torch.TorchOps`): layer constants (GLU activation,
router, KDA) and the weight bundles `prepare_*` reads, as the layers hold them after loading."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .activations import silu_and_mul, situ_and_mul


@dataclass(frozen=True)
class GluAct:
    """A GLU activation: SiTU with (beta, linear_beta) for K3, SwiGLU (`silu`) for Kimi-Linear."""

    kind: str  # "situ" | "silu"
    beta: float = 0.0
    linear_beta: float | None = None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "situ":
            return situ_and_mul(gate, up, self.beta, self.linear_beta)
        return silu_and_mul(gate, up)


@dataclass(frozen=True)
class RouteSpec:
    """The router's constants (`ops.moe.route` arguments after the bias)."""

    top_k: int
    num_expert_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    bias_in_weights: bool = False

    def args(self) -> tuple:
        return (
            self.top_k,
            self.num_expert_group,
            self.topk_group,
            self.renormalize,
            self.routed_scaling_factor,
            self.bias_in_weights,
        )


@dataclass(frozen=True)
class KdaSpec:
    """A KDA layer's constants."""

    heads: int
    head_dim: int
    lower_bound: float | None  # K3's sigmoid gate bound; None: Kimi-Linear's softplus gate
    eps: float  # output norm
    scale: float


@dataclass
class ExpertWeights:
    """Routed experts: dense `w1, w3 [E, I, Din]`, `w2 [E, Din, I]`, or MXFP4 `(packed, scale)` pairs
    decoded on the fly to `dtype`."""

    w1: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    w3: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    w2: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    dtype: torch.dtype | None = None

    @property
    def packed(self) -> bool:
        return isinstance(self.w1, tuple)

    @property
    def num(self) -> int:
        """How many experts the tensors hold."""
        return (self.w1[0] if self.packed else self.w1).shape[0]

    def operands(self) -> tuple:
        return self.w1, self.w3, self.w2


class PackedExpertView:
    """`[E, O, I]`-shaped read access to packed experts: `view[e]` decodes expert e with `decode`."""

    def __init__(self, pair: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, decode: Callable):
        self.packed, self.scale = pair
        self.dtype, self.decode = dtype, decode
        self.shape = torch.Size((*self.packed.shape[:2], self.packed.shape[2] * 2))

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.decode(self.packed[e], self.scale[e], self.dtype)


@dataclass
class KdaWeights:
    """One KDA layer's tensors as loaded (the bundle `prepare_kda` reads)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    f_a: torch.Tensor
    f_b: torch.Tensor
    b: torch.Tensor
    g: torch.Tensor  # g_proj (full-rank gate) or g_a_proj
    g_b: torch.Tensor | None  # g_b_proj (low-rank gate)
    o: torch.Tensor
    conv: torch.Tensor  # fused depthwise weight [3P, W]
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor  # output norm weight [K]


@dataclass
class MlaWeights:
    """One MLA layer's tensors as loaded (the bundle `prepare_mla` reads)."""

    q_first: torch.Tensor  # q_a_proj or q_proj
    q_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    kv_a: torch.Tensor
    kv_norm: torch.Tensor
    g: torch.Tensor | None
    w_uk: torch.Tensor  # [H, nope, R] view of kv_b_proj
    w_uv: torch.Tensor  # [H, v, R] view of kv_b_proj
    heads: int
    nope: int
    rope: int
    q_eps: float
    kv_eps: float
    scale: float


@dataclass
class MoeWeights:
    """One MoE block's tensors as loaded (the bundle `prepare_moe` reads)."""

    gate: torch.Tensor
    bias: torch.Tensor | None
    experts: ExpertWeights
    act: GluAct
    route: RouteSpec
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None
    norm: torch.Tensor | None = None
    norm_eps: float = 0.0
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    shared_act: GluAct | None = None
    # experts (and shared experts) hold one tensor-parallel shard of their intermediate dim, or (expert
    # parallelism) `experts` holds the router's experts [first, first + its count): the routed sum is
    # partial, so a block that applies `norm` to it would be wrong
    partial: bool = False
    first: int = 0


@dataclass(frozen=True)
class ServedShapes:
    """What decides, per op family, whether a backend's kernels admit a loaded model (`describe`):
    its dtype, its cache pools' dtypes and its per-rank attention shapes."""

    dtype: torch.dtype
    kv_dtype: torch.dtype  # MLA latent rows and KDA conv tails
    state_dtype: torch.dtype  # KDA recurrent states
    mla_heads: int  # MLA heads on this rank (0: no MLA layer)
    mla_rank: int  # kv_lora_rank
    mla_rope: int  # qk_rope_head_dim
    mla_width: int  # the widest head of the unabsorbed prefill: max(nope + rope, v)
    kda_gate: str  # "sigmoid" (K3) | "softplus" (Kimi-Linear) | "" (no KDA layer)


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16 (start-up lines)."""
    return str(dtype).removeprefix("torch.")
