"""`model.modules.project`: several projections of one input in one native call (bf16, small
batches) equal the separate linears; fp32 outputs are the unrounded accumulation."""

import pytest
import torch
from torch import nn

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.model.fused import prepare_model
from deltaserve.model.modules import empty_linear, project
from deltaserve.ops.backends.cpu import CpuNativeOps

NK = cpu_kernels.native()
pytestmark = pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable")
BF = torch.bfloat16


def test_project_matches_separate_linears(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    layers = [empty_linear(192, n).to(BF) for n in (512, 8, 37, 300)]
    for m in layers:
        m.weight.data = (torch.randn(m.weight.shape, generator=gen) * 0.1).to(BF)
    x = torch.randn(3, 192, generator=gen).to(BF)
    prepare_model(nn.ModuleList(layers), CpuNativeOps(NK))
    calls = []
    real = cpu_kernels.NativeKernels.linear_bf16_multi
    monkeypatch.setattr(
        cpu_kernels.NativeKernels, "linear_bf16_multi", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    with torch.no_grad():
        outs = project(x, *layers, f32=(False, True, False, True))
        assert calls == [1]
        for m, y, f in zip(layers, outs, (False, True, False, True)):
            ref = x.float() @ m.weight.float().T
            if f:
                assert y.dtype == torch.float32
                torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(y, NK.linear_bf16(x, m.weight))
                torch.testing.assert_close(y.float(), m(x).float(), rtol=1e-2, atol=1e-2)
        wide = torch.randn(NK.multi_rows(192) + 1, 192, generator=gen).to(BF)
        fallback = project(wide, *layers[:2], f32=(False, True))
        assert calls == [1]  # too many rows: the torch path
        assert torch.equal(fallback[0], layers[0](wide))
        torch.testing.assert_close(fallback[1], wide.float() @ layers[1].weight.float().T)
