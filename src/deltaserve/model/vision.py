"""The K3 vision path (spec/model.md §12.2-12.5): MoonViT3d tower, `sd2_tpool` merge and the
`patchmergerv2` projector, with parameter names equal to the checkpoint's (`vision_tower.*`,
`mm_projector.*`, §12.2 tables). Sizes come from `config.json`'s `vision_config`.

Tower norms are `nn.RMSNorm` with eps unset upstream. PyTorch then takes the epsilon of the
op's compute type (float32 for bf16/fp16 input: ~1.19e-7, not bf16's 2^-7 as OQ-5 assumed;
checked on torch 2.13 CPU and 2.11 CUDA), so that is the default here unless the config pins
one; the projector's `post_norm` uses `projector_ln_eps`. Linears and norms run on
the bound op backend (`OpsModule`), attention too (`vision_attention`, `vision_image_attention`);
RoPE2D and the merge are `ops.vision` functions. Attention is per image in bounded query chunks
(`ops.vision.image_attention` behind the backend), so a forward pass needs memory linear in its
patches; `model/vision_encode.py` runs one image in pieces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..ops import vision as vops
from .config import ConfigError, _field
from .modules import OpsModule, RMSNorm, empty_linear

# the only variants of the §1.4 string-valued keys this tower implements (key -> value)
_FIXED = {
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "projector_hidden_act": "gelu",
    "activation_func": "gelu_pytorch_tanh",
    "norm_type": "rmsnorm",
    "pos_emb_interpolation_mode": "bilinear",
}


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int  # vt_hidden_size (= mm_hidden_size)
    num_layers: int
    num_heads: int
    qkv_size: int  # width of each of q, k, v (heads * head_dim)
    intermediate_size: int
    patch_size: int
    merge_kernel: tuple[int, int]
    pos_emb_hw: tuple[int, int]  # learned table size (init_pos_emb_height/width)
    text_hidden_size: int  # projector output
    projector_eps: float
    norm_eps: float | None = None  # tower norms; None: PyTorch's default (the compute type's eps)
    rope_theta: float = 10000.0  # §12.3 constant (no config key)

    @property
    def head_dim(self) -> int:
        return self.qkv_size // self.num_heads

    @property
    def patch_bytes(self) -> int:
        """Upper bound on the fp32 activation bytes one patch row needs inside a block (input,
        q/k/v, attention output, MLP hidden, output), the linear part of an encode's memory."""
        return 4 * (3 * self.hidden_size + 4 * self.qkv_size + 2 * self.intermediate_size)

    @property
    def merged_size(self) -> int:
        """Projector input: one merge window of tower rows."""
        return self.hidden_size * self.merge_kernel[0] * self.merge_kernel[1]

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **overrides: Any) -> "VisionConfig":
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read ({e})") from None
        return cls.from_dict(raw, **overrides)

    @classmethod
    def from_dict(cls, raw: dict, **overrides: Any) -> "VisionConfig":
        """From a whole K3 config (its `vision_config`) or the `vision_config` object itself."""
        v = raw.get("vision_config", raw) if isinstance(raw, dict) else None
        w = "vision_config"
        if not isinstance(v, dict):
            raise ConfigError(f"{w}: missing or not an object")
        for key, want in _FIXED.items():
            got = v.get(key, want)
            if got != want:
                raise ConfigError(f"{w}: '{key}' is {got!r}; only {want!r} is implemented")
        hidden = _field(v, "vt_hidden_size", int, w)
        if _field(v, "mm_hidden_size", int, w, default=hidden) != hidden:
            raise ConfigError(f"{w}: 'mm_hidden_size' {v['mm_hidden_size']} != 'vt_hidden_size' {hidden}")
        heads = _field(v, "vt_num_attention_heads", int, w)
        qkv = _field(v, "qkv_hidden_size", int, w, default=hidden)
        if qkv % heads or (qkv // heads) % 4:
            raise ConfigError(f"{w}: 'qkv_hidden_size' {qkv} / {heads} heads must be a multiple of 4 (RoPE2D)")
        kernel = _field(v, "merge_kernel_size", list, w)
        if len(kernel) != 2 or not all(isinstance(k, int) and k >= 1 for k in kernel):
            raise ConfigError(f"{w}: 'merge_kernel_size' must be two positive ints, got {kernel}")
        values = dict(
            hidden_size=hidden,
            num_layers=_field(v, "vt_num_hidden_layers", int, w),
            num_heads=heads,
            qkv_size=qkv,
            intermediate_size=_field(v, "vt_intermediate_size", int, w),
            patch_size=_field(v, "patch_size", int, w),
            merge_kernel=(kernel[0], kernel[1]),
            pos_emb_hw=(_field(v, "init_pos_emb_height", int, w), _field(v, "init_pos_emb_width", int, w)),
            text_hidden_size=_field(v, "text_hidden_size", int, w),
            projector_eps=_field(v, "projector_ln_eps", float, w),
        )
        values.update(overrides)
        return cls(**values)


class VisionRMSNorm(RMSNorm):
    """`nn.RMSNorm` with eps unset: eps None means what PyTorch uses then, the epsilon of the
    compute type (`promote_types(x.dtype, float32)`: fp32's for bf16 input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps if self.eps is None else self.eps
        return self.ops.rms_norm(x, self.weight, eps, self.prepared)


class PosEmb(nn.Module):
    """The learned position table `weight [H0, W0, D]`."""

    def __init__(self, h: int, w: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(h, w, dim))


class PatchEmbed(OpsModule):
    """Conv2d(3 -> D, kernel = stride = patch, no bias) on whole patches, i.e. one linear over
    the flattened `[3, P, P]` patch, plus the position table resized to each image's grid."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, p, p, bias=False)
        self.pos_emb = PosEmb(*cfg.pos_emb_hw, cfg.hidden_size)

    def forward(self, patches: torch.Tensor, grid_hws: list[tuple[int, int]]) -> torch.Tensor:
        x = self.ops.linear(patches.flatten(1), self.proj.weight.flatten(1))
        pos = torch.cat([vops.interp_pos_emb(self.pos_emb.weight, h, w) for h, w in grid_hws])
        return x + pos


class VisionMlp(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = empty_linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc1 = empty_linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(vops.gelu_tanh(self.fc0(x)))


class VisionBlock(OpsModule):
    """Pre-norm block: `p += wo(Attn(RoPE2D(q), RoPE2D(k), v))`, `p += mlp(norm1(p))`. Split in
    `qkv` (every row of an image) and `rows` (any subset of its rows, given the whole image's
    k, v): everything but attention is row-wise, so a block may run a chunk of rows at a time."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.qkv_size = cfg.num_heads, cfg.qkv_size
        self.norm0 = VisionRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.wqkv = empty_linear(cfg.hidden_size, 3 * cfg.qkv_size)
        self.wo = empty_linear(cfg.qkv_size, cfg.hidden_size)
        self.norm1 = VisionRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = VisionMlp(cfg)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """RoPE2D'd q, k and v `[L, H, D]` of rows `x [L, hidden]` (cos/sin of the same rows)."""
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, -1)).unbind(1)
        return vops.apply_rope2d(q, cos, sin), vops.apply_rope2d(k, cos, sin), v

    def rows(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The block's output for rows `x` with queries `q`, against ONE image's whole `k, v`."""
        x = x + self.wo(self.ops.vision_image_attention(q, k, v).flatten(1))
        return x + self.mlp(self.norm1(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Packed images of `lengths` rows, each attending only to itself."""
        q, k, v = self.qkv(x, cos, sin)
        x = x + self.wo(self.ops.vision_attention(q, k, v, lengths).flatten(1))
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = VisionRMSNorm(cfg.hidden_size, cfg.norm_eps)


class MoonViT3d(nn.Module):
    """Patches `[L, 3, P, P]` of packed images -> tower states `[L, D]` (§12.2). Each image
    attends only to itself; RoPE2D positions restart at each image."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, patches: torch.Tensor, grid_hws: list[tuple[int, int]]) -> torch.Tensor:
        x = self.patch_embed(patches, grid_hws)
        rows, cols = vops.grid_positions(grid_hws, x.device)
        cos, sin = vops.rope2d_cos_sin(rows, cols, self.cfg.head_dim, self.cfg.rope_theta)
        lengths = [h * w for h, w in grid_hws]
        for block in self.encoder.blocks:
            x = block(x, cos, sin, lengths)
        return self.encoder.final_layernorm(x)


class PatchMergerV2(nn.Module):
    """`post_norm(proj.2(gelu_erf(proj.0(u))))` on merged windows `u` (§12.5)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        m = cfg.merged_size
        self.proj = nn.ModuleList([empty_linear(m, m), nn.Identity(), empty_linear(m, cfg.text_hidden_size)])
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_eps)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj[2](vops.gelu(self.proj[0](u))))


class VisionModel(nn.Module):
    """Packed images -> text-width embeddings, one row per merge window, images in order."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = MoonViT3d(cfg)
        self.mm_projector = PatchMergerV2(cfg)

    def check_grids(self, patches: torch.Tensor, grid_thws: list) -> list[tuple[int, int, int]]:
        """Grids as int triples; images only (t = 1: the video time embedding has no tensor)."""
        grids = [tuple(int(n) for n in g) for g in grid_thws]
        kh, kw = self.cfg.merge_kernel
        p = self.cfg.patch_size
        for t, h, w in grids:
            if t != 1 or h % kh or w % kw:
                raise ValueError(f"grid_thw {(t, h, w)}: need t = 1 and h, w multiples of {kh}x{kw}")
        if patches.dim() != 4 or tuple(patches.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel patches must be [L, 3, {p}, {p}], got {tuple(patches.shape)}")
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{patches.shape[0]} patches for grids {grids}")
        return grids

    def tower(self, patches: torch.Tensor, grid_thws: list) -> torch.Tensor:
        """MoonViT3d states `[L, D]` (before the merge)."""
        grids = self.check_grids(patches, grid_thws)
        patches = patches.to(self.mm_projector.post_norm.weight.dtype)
        return self.vision_tower(patches, [(h, w) for _, h, w in grids])

    def merge(self, states: torch.Tensor, grid_thws: list) -> torch.Tensor:
        """`sd2_tpool` windows `[sum N_i, kh*kw*D]`."""
        return vops.sd2_tpool(states, [tuple(int(n) for n in g) for g in grid_thws], self.cfg.merge_kernel)

    def forward(self, pixel_patches: torch.Tensor, grid_thws: list) -> torch.Tensor:
        """`[L, 3, P, P]` patches of images with `grid_thws` -> `[sum N_i, text_hidden]`."""
        return self.mm_projector(self.merge(self.tower(pixel_patches, grid_thws), grid_thws))
