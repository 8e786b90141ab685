"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`) codec (spec/model.md §16).

`weight_packed [O, I/2]` uint8 holds E2M1 codes, the LOW nibble the EARLIER element;
`weight_scale [O, I/32]` uint8 holds E8M0 biased exponents (bias 127, 0xFF = NaN) for groups
of 32 along the input dim.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise to `[O, I]` in dtype, exactly (bf16 holds every value of the format in the
    normal exponent range). Raises ValueError on a NaN scale (0xFF) or mismatched shapes."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError("MXFP4 weight_packed and weight_scale must be uint8")
    rows, half = packed.shape
    if scale.shape != (rows, half * 2 // GROUP_SIZE) or (half * 2) % GROUP_SIZE:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    if bool((scale == 0xFF).any()):
        raise ValueError("MXFP4 scale holds 0xFF (NaN)")
    lut = E2M1.to(packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, half * 2)
    vals = lut[codes.long()].view(rows, -1, GROUP_SIZE)
    exps = torch.exp2(scale.float() - 127.0).unsqueeze(-1)
    return (vals * exps).reshape(rows, half * 2).to(dtype)


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `[O, I]` (I a multiple of 32) to (packed uint8 [O, I/2], scale uint8 [O, I/32]):
    per group the smallest power-of-two scale such that max|w|/scale <= 6, values rounded to the
    nearest E2M1 code. decode(encode(w)) == w whenever w is already representable."""
    rows, cols = w.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"input dim {cols} is not a multiple of {GROUP_SIZE}")
    g = w.float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)   # ties: lowest code
    codes = codes.view(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8)
