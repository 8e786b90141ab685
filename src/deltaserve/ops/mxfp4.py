"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`) codec (spec/model.md §16).

`weight_packed [O, I/2]` uint8 holds E2M1 codes, the LOW nibble the EARLIER element;
`weight_scale [O, I/32]` uint8 holds E8M0 biased exponents (bias 127, 0xFF = NaN) for groups
of 32 along the input dim.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise to `[O, I]` in dtype, exactly (bf16 holds every value of the format in the
    normal exponent range). Raises ValueError on a NaN scale (0xFF) or mismatched shapes."""
    raise NotImplementedError


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `[O, I]` (I a multiple of 32) to (packed uint8 [O, I/2], scale uint8 [O, I/32]):
    per group the smallest power-of-two scale such that max|w|/scale <= 6, values rounded to the
    nearest E2M1 code. decode(encode(w)) == w whenever w is already representable."""
    raise NotImplementedError
