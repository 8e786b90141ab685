"""MXFP4 codec (spec/model.md §16): the fast decoder against the naive per-element reading of the
formula, hand-built tensors that each catch one classic mistake (nibble order, grouping
direction, scale bias/sign, sign bit), error handling, and encode's scale choice and rounding."""

import pytest
import torch

from deltaserve.ops.mxfp4 import mxfp4_decode, mxfp4_encode
from deltaserve.ops.reference.mxfp4 import E2M1_TABLE, naive_mxfp4_decode

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (tells -0.0 from +0.0 and compares infinities)."""
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_decode_matches_naive_bit_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    rows, cols = 6, 256
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    packed[:2] = torch.arange(256, dtype=torch.uint8).view(2, 128)  # every byte once
    scale = torch.randint(0, 255, (rows, cols // 32), generator=g, dtype=torch.uint8)
    scale[0] = torch.tensor([0, 1, 100, 127, 128, 200, 253, 254], dtype=torch.uint8)  # extremes
    want = naive_mxfp4_decode(packed, scale).to(dtype)
    assert same_bits(mxfp4_decode(packed, scale, dtype), want)


def test_e2m1_table_and_sign_bit():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8)
    w = mxfp4_decode(packed, torch.full((1, 1), 127, dtype=torch.uint8), torch.float32)
    assert w[0, :16].tolist() == list(E2M1_TABLE)
    assert torch.signbit(w[0, 8])  # code 8 is -0.0


def test_low_nibble_is_the_earlier_element():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x72  # low nibble 2 (1.0), high nibble 7 (6.0)
    packed[0, 1] = 0x9C  # low nibble C (-2.0), high nibble 9 (-0.5)
    w = mxfp4_decode(packed, torch.full((1, 1), 127, dtype=torch.uint8), torch.float32)
    assert w[0, :4].tolist() == [1.0, 6.0, -2.0, -0.5]


def test_groups_run_along_the_input_dim():
    rows, cols = 3, 96
    packed = torch.full((rows, cols // 2), 0x22, dtype=torch.uint8)  # every element 1.0
    scale = torch.tensor([[127, 128, 129], [130, 131, 132], [120, 121, 122]], dtype=torch.uint8)
    w = mxfp4_decode(packed, scale, torch.float32)
    expect = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1).float()
    assert torch.equal(w, expect)
    assert w[0, 31] == 1.0 and w[0, 32] == 2.0 and w[1, 0] == 8.0 and w[2, 95] == 2.0**-5


def test_scale_is_unsigned_with_bias_127():
    packed = torch.full((1, 64), 0x22, dtype=torch.uint8)  # 1.0 everywhere
    for byte, value in [(127, 1.0), (0, 2.0**-127), (1, 2.0**-126), (200, 2.0**73), (254, 2.0**127)]:
        scale = torch.tensor([[byte, 127, 127, 127]], dtype=torch.uint8)
        w = mxfp4_decode(packed, scale, torch.float32)
        assert w[0, 0].item() == value and w[0, 32].item() == 1.0, byte


def test_errors():
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_decode(packed, torch.tensor([[127, 127], [127, 255]], dtype=torch.uint8))
    with pytest.raises(ValueError, match="shapes"):
        mxfp4_decode(packed, torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shapes"):
        mxfp4_decode(packed, torch.zeros(1, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="shapes"):
        mxfp4_decode(torch.zeros(2, 24, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_decode(packed.to(torch.int8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_encode(torch.zeros(2, 48))


def test_encode_picks_the_smallest_power_of_two_scale():
    w = torch.zeros(5, 32)
    w[0, 3], w[1, 3], w[2, 3], w[3, 3] = 6.0, 6.0001, 3.0, -0.75
    _, scale = mxfp4_encode(w)
    assert scale[:, 0].tolist() == [127, 128, 126, 124, 0]  # all-zero group: byte 0


def test_encode_rounds_to_nearest_ties_to_even():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w = torch.zeros(1, 32)
    w[0, 0] = 6.0  # pins the scale at 2^0
    w[0, 1:8] = torch.tensor(mids)
    w[0, 8:15] = -torch.tensor(mids)
    w[0, 15:22] = torch.nextafter(torch.tensor(mids), torch.tensor(10.0))  # just above: round up
    got = mxfp4_decode(*mxfp4_encode(w), torch.float32)[0]
    assert got[1:8].tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert got[8:15].tolist() == [0, -1, -1, -2, -2, -4, -4]
    assert got[15:22].tolist() == [0.5, 1, 1.5, 2, 3, 4, 6]


def test_round_trip_exact_for_representable_weights():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (8, 128), generator=g, dtype=torch.uint8)
    scale = torch.randint(20, 235, (8, 8), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        w = mxfp4_decode(packed, scale, dtype)
        assert torch.equal(mxfp4_decode(*mxfp4_encode(w), dtype), w)


def test_encode_error_is_the_nearest_code():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 256, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(1)
    packed, scale = mxfp4_encode(w)
    got = mxfp4_decode(packed, scale, torch.float32).double()
    step = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=1)
    grid = torch.tensor(E2M1_TABLE, dtype=torch.float64)
    nearest = ((w.double() / step).unsqueeze(-1) - grid).abs().amin(-1) * step
    assert torch.allclose((got - w.double()).abs(), nearest, rtol=0, atol=1e-12 * w.abs().max().item())
    amax = w.abs().view(16, 8, 32).amax(-1).repeat_interleave(32, dim=1).double()
    assert ((got - w.double()).abs() <= amax / 3).all()
    assert (w.abs().view(16, 8, 32).amax(-1) / torch.exp2(scale.float() - 127) <= 6).all()
