"""Naive MXFP4 decoder for tests: the spec/model.md §16 formula read element by element.

For every output element `W[o, j]`: byte `packed[o, j // 2]`, its LOW nibble when j is even and
its HIGH nibble when j is odd, looked up in the E2M1 table, times `2^(scale[o, j // 32] - 127)`.
Computed in Python floats and returned as float64 (exact for every scale byte 0..254).
"""

from __future__ import annotations

import torch

E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def naive_mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`[O, I/2]` uint8 codes and `[O, I/32]` uint8 exponents -> `[O, I]` float64."""
    rows, half = packed.shape
    codes, exps = packed.tolist(), scale.tolist()
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    for o in range(rows):
        for j in range(half * 2):
            byte = codes[o][j // 2]
            code = byte & 0x0F if j % 2 == 0 else byte >> 4
            s = exps[o][j // 32]
            if s == 0xFF:
                raise ValueError("MXFP4 scale holds 0xFF (NaN)")
            out[o, j] = E2M1_TABLE[code] * 2.0 ** (s - 127)
    return out
