"""MXFP4 decode vs a per-element reading of the spec formula; nibble order, grouping direction
and scale bias each pinned by a hand-built tensor; encode/decode round trip."""
import pytest
import torch

from deltaserve.ops.mxfp4 import mxfp4_decode, mxfp4_encode

TABLE = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]


def naive(packed, scale):
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    for o in range(rows):
        for j in range(half * 2):
            byte = int(packed[o, j // 2])
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            out[o, j] = TABLE[code] * 2.0 ** (int(scale[o, j // 32]) - 127)
    return out


def test_decode_matches_naive_bit_exactly():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 32), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 150, (3, 2), generator=g, dtype=torch.uint8)
    got = mxfp4_decode(packed, scale, torch.bfloat16)
    assert torch.equal(got.double(), naive(packed, scale))


def test_nibble_order_grouping_and_bias():
    packed = torch.zeros(1, 32, dtype=torch.uint8)
    packed[0, 0] = 0x72                       # low nibble 2 (=1.0) first, high 7 (=6.0) second
    scale = torch.tensor([[127, 129]], dtype=torch.uint8)
    packed[0, 16] = 0x01                      # element 32 (group 1) = 0.5 * 2^2
    w = mxfp4_decode(packed, scale, torch.float32)
    assert w[0, 0] == 1.0 and w[0, 1] == 6.0 and w[0, 32] == 2.0


def test_nan_scale_and_shape_errors():
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_decode(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shapes"):
        mxfp4_decode(torch.zeros(1, 16, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.uint8))


def test_round_trip():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (4, 64), generator=g, dtype=torch.uint8)
    scale = torch.randint(110, 140, (4, 4), generator=g, dtype=torch.uint8)
    w = mxfp4_decode(packed, scale, torch.float32)
    assert torch.equal(mxfp4_decode(*mxfp4_encode(w), torch.float32), w)
    x = torch.randn(4, 64, generator=g)
    err = (mxfp4_decode(*mxfp4_encode(x), torch.float32) - x).abs().max()
    assert err < x.abs().max() / 4
