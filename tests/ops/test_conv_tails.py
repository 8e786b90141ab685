"""`conv_tails_at` equals the final conv tail of each requested prefix (the prefix cache's
checkpoint of the short conv), with and without a prior tail."""

import pytest
import torch

from deltaserve.ops.kda import causal_conv1d, conv_tails_at


@pytest.mark.parametrize("with_prior", [False, True])
def test_tails_at_offsets_equal_prefix_final_tails(with_prior):
    g = torch.Generator().manual_seed(0)
    lens, c, w = [9, 2, 5], 6, 4
    x = torch.randn(sum(lens), c, generator=g)
    weight = torch.randn(c, w, generator=g)
    cu = torch.tensor([0, *lens]).cumsum(0)
    prior = torch.randn(len(lens), w - 1, c, generator=g) if with_prior else None
    offsets = [[1, 3, 9], [2], [1, 4]]
    got = conv_tails_at(x, cu, prior, offsets, w)
    want = []
    for b, offs in enumerate(offsets):
        for o in offs:
            seg = x[cu[b] : cu[b] + o]
            _, tail = causal_conv1d(seg, weight, torch.tensor([0, o]), None if prior is None else prior[b : b + 1])
            want.append(tail[0])
    assert torch.equal(got, torch.stack(want))
    with pytest.raises(ValueError):
        conv_tails_at(x, cu, prior, [[0], [], []], w)
    with pytest.raises(ValueError):
        conv_tails_at(x, cu, prior, [[], [3], []], w)
