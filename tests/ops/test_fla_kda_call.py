"""How `kernels.extern.fla_kda` calls fla-core's `chunk_kda` (a stand-in here: fla-core is never
installed where the tests run): packed inputs as one batch row, and the host copy of
`cu_seqlens` as `cu_seqlens_cpu` exactly when the installed release accepts it."""

import pytest
import torch

from deltaserve.kernels.extern import fla_kda
from deltaserve.kernels.transfer import to_device


def _stand_in(calls, takes_host_cu: bool):
    def chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, **more):
        calls.append({"cu_seqlens": cu_seqlens, "q": q, **more})
        return v.float(), initial_state

    if not takes_host_cu:
        return chunk_kda

    def chunk_kda_with_host(q, k, v, g, beta, *, cu_seqlens_cpu=None, **kw):
        return chunk_kda(q, k, v, g, beta, cu_seqlens_cpu=cu_seqlens_cpu, **kw)

    return chunk_kda_with_host


@pytest.mark.parametrize("takes_host_cu", [False, True])
def test_host_cu_seqlens_passed_only_where_accepted(monkeypatch, takes_host_cu):
    calls = []
    monkeypatch.setattr(fla_kda, "_chunk_kda", lambda: _stand_in(calls, takes_host_cu))
    fla_kda._takes_host_cu.cache_clear()
    try:
        n, h, d = 5, 2, 4
        q, k, v, g = (torch.randn(n, h, d) for _ in range(4))
        host = torch.tensor([0, 2, 5])
        cu = to_device({"cu": host}, "cpu")["cu"]
        o, final = fla_kda.chunk_kda(q, k, v, g, torch.rand(n, h), cu, 0.5, dtype=torch.bfloat16)
    finally:
        fla_kda._takes_host_cu.cache_clear()
    (call,) = calls
    assert call["q"].shape == (1, n, h, d) and call["q"].dtype == torch.bfloat16
    assert torch.equal(call["cu_seqlens"], host)
    if takes_host_cu:
        assert call["cu_seqlens_cpu"].device.type == "cpu" and torch.equal(call["cu_seqlens_cpu"], host)
    else:
        assert "cu_seqlens_cpu" not in call
    assert final.shape == (2, h, d, d) and not final.any()  # zero initial state for two sequences
    assert torch.equal(o, v.to(torch.bfloat16).float())
