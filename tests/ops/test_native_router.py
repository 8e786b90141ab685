"""The native router selection (`ds_route`) against `ops.moe.route` on the same logits."""

import pytest
import torch

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.ops.moe import route

NK = cpu_kernels.native()
pytestmark = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")


@pytest.mark.parametrize(
    "groups,topk_group,top_k,renorm,bias_in_weights,with_bias",
    [
        (1, 1, 8, True, False, True),
        (8, 3, 6, True, False, True),
        (4, 2, 5, False, True, True),
        (64, 5, 5, True, False, True),
        (1, 1, 4, True, False, False),
    ],
)
def test_route_matches_torch(groups, topk_group, top_k, renorm, bias_in_weights, with_bias):
    gen = torch.Generator().manual_seed(groups * 31 + top_k)
    x = torch.randn(33, 128, generator=gen)
    w = torch.randn(64, 128, generator=gen) * 0.1
    b = torch.randn(64, generator=gen) * 0.1 if with_bias else None
    ref_w, ref_ids = route(x, w, b, top_k, groups, topk_group, renorm, 2.5, bias_in_weights)
    got_w, got_ids = NK.route(x @ w.T, b, top_k, groups, topk_group, renorm, 2.5, bias_in_weights)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-7)


def test_route_declines_what_it_cannot_do():
    logits = torch.randn(2, 16)
    assert NK.route(logits, None, 5, 4, 1, True, 1.0, False) is None  # 5 > one group of 4
    assert NK.route(logits, None, 2, 3, 1, True, 1.0, False) is None  # 16 experts, 3 groups
    with pytest.raises(ValueError):
        NK.route(logits.double(), None, 2, 1, 1, True, 1.0, False)
