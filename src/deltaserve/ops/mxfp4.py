"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`) codec (spec/model.md §16).

`weight_packed [O, I/2]` uint8 holds E2M1 codes, the LOW nibble the EARLIER element;
`weight_scale [O, I/32]` uint8 holds E8M0 biased exponents (bias 127, 0xFF = NaN) for groups
of 32 along the input dim.

Decoding is exact: an E2M1 value has two significant bits, so `value * 2^(s-127)` is exactly
representable in fp32 and bf16 for every scale 0..254 (the top scales overflow to ±inf, as the
formula itself does in those formats).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])

# byte -> (value of the low nibble, value of the high nibble)
_BYTE_LUT = torch.stack([E2M1[torch.arange(256) & 0x0F], E2M1[torch.arange(256) >> 4]], dim=-1)
# E8M0 byte -> 2^(s - 127), exact in fp32 (2^-127 is an fp32 subnormal); entry 255 unused (NaN)
_SCALE_LUT = torch.exp2(torch.arange(256, dtype=torch.float64) - 127).float()
# round-to-nearest-even thresholds between neighbouring magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6:
# a magnitude above threshold k takes a code > k. Where the tie goes up (k odd) the threshold is
# the float just below the midpoint, so the midpoint itself rounds to the even code k + 1.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_THRESHOLDS = tuple(
    torch.nextafter(torch.tensor(m), torch.tensor(0.0)).item() if k % 2 else m for k, m in enumerate(_MIDPOINTS)
)
_EXACT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def mxfp4_validate(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """The decoded shape `(O, I)`; ValueError on wrong dtypes, mismatched shapes or a NaN scale."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError("MXFP4 weight_packed and weight_scale must be uint8")
    if packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scale {tuple(scale.shape)} (both must be 2-D)"
        )
    rows, half = packed.shape
    cols = half * 2
    if cols % GROUP_SIZE or tuple(scale.shape) != (rows, cols // GROUP_SIZE):
        raise ValueError(
            f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}"
            f" (expected scale [{rows}, {cols}/{GROUP_SIZE}])"
        )
    if bool((scale == 0xFF).any()):
        raise ValueError("MXFP4 scale holds 0xFF (NaN)")
    return rows, cols


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise to `[O, I]` in dtype, exactly (bf16 holds every value of the format in the
    normal exponent range). Raises ValueError on a NaN scale (0xFF) or mismatched shapes."""
    rows, cols = mxfp4_validate(packed, scale)
    work = dtype if dtype in _EXACT_DTYPES else torch.float32
    byte_lut = _BYTE_LUT.to(device=packed.device, dtype=work)
    scale_lut = _SCALE_LUT.to(device=packed.device, dtype=work)
    vals = byte_lut[packed.long()].view(rows, cols // GROUP_SIZE, GROUP_SIZE)
    out = (vals * scale_lut[scale.long()].unsqueeze(-1)).view(rows, cols)
    return out if work == dtype else out.to(dtype)


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `[O, I]` (I a multiple of 32) to (packed uint8 [O, I/2], scale uint8 [O, I/32]):
    per group the smallest power-of-two scale such that max|w|/scale <= 6, values rounded to the
    nearest E2M1 code. decode(encode(w)) == w whenever w is already representable.

    Ties round to the even code (mantissa bit 0), as OCP MX round-to-nearest-even does: 0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (times the scale). An all-zero group
    gets scale byte 0; magnitudes beyond the format's range clamp to exponents [-127, 127]."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"input dim {cols} is not a multiple of {GROUP_SIZE}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("cannot encode non-finite weights")
    g = w.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    amax = g.abs().amax(-1)
    # smallest e with amax / 2^e <= 6, i.e. ceil(log2(amax / 6)), without log2 rounding error
    mant, e = torch.frexp(amax.double() / 6.0)  # amax/6 = mant * 2^e, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, e - 1, e)
    exp = torch.where(amax == 0, torch.full_like(exp, -127), exp).clamp(-127, 127)
    scaled = g / _SCALE_LUT.to(w.device)[exp + 127].unsqueeze(-1)  # exact: a power-of-two division
    mag = scaled.abs()
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=w.device)
    for threshold in _THRESHOLDS:
        code += mag > threshold
    code |= ((scaled < 0) & (code > 0)).to(torch.uint8) << 3  # sign bit; zero is stored as +0
    code = code.view(rows, cols)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8)
