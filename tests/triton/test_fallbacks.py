"""The Triton backend's per-call fallbacks are counted by (op, reason) (`ops.fallbacks`): a decode step
over bf16 KDA states (the recurrent kernel keeps fp32 states) declines with `cache_dtype` and the
start-up line says the decode runs on torch; float64 operands run the reference with `dtype`; the
start-up line names an optional library only where its window admits the model."""

import pytest
import torch

from .common import DEVICE, KERNEL_MARKS

triton = pytest.importorskip("triton")

from deltaserve.ops import fallbacks  # noqa: E402
from deltaserve.ops.backends.select import describe  # noqa: E402
from deltaserve.ops.backends.torch import REFERENCE  # noqa: E402
from deltaserve.ops.backends.triton import TritonOps  # noqa: E402
from deltaserve.ops.operands import ServedShapes  # noqa: E402

pytestmark = KERNEL_MARKS
OPS = TritonOps()
PREPARED = object()  # kda_decode reads no field of its plan before the pool check
DECLINED = object()  # what `otherwise` answers: the backend declined its plan


def test_kda_decode_over_bf16_states_counts_cache_dtype():
    h, d, n = 2, 16, 3
    tails = torch.zeros(4, 3, 3 * h * d, dtype=torch.bfloat16, device=DEVICE)
    view = (tails, torch.zeros(4, h, d, d, dtype=torch.bfloat16, device=DEVICE), torch.arange(n, device=DEVICE))
    before = fallbacks.snapshot()
    x = torch.randn(n, 32, dtype=torch.bfloat16, device=DEVICE)
    assert OPS.kda_decode(x, PREPARED, view, lambda: DECLINED) is DECLINED
    assert fallbacks.since(before) == {("kda_decode", "cache_dtype"): 1}
    line = describe(OPS, ServedShapes(torch.bfloat16, torch.bfloat16, torch.bfloat16, 8, 512, 64, 192, "sigmoid"))
    assert "decode on torch: the recurrent kernel keeps fp32 states, not bfloat16" in line


def test_float64_norm_runs_the_reference_and_counts_dtype():
    x, w = torch.randn(3, 8, dtype=torch.float64, device=DEVICE), torch.randn(8, dtype=torch.float64, device=DEVICE)
    before = fallbacks.snapshot()
    assert torch.equal(OPS.rms_norm(x, w, 1e-6), REFERENCE.rms_norm(x, w, 1e-6))
    assert fallbacks.since(before) == {("rms_norm", "dtype"): 1}


def test_startup_line_lists_only_the_libraries_whose_windows_admit_the_model(monkeypatch):
    from deltaserve.kernels.extern import fla_kda, flash_prefill, flashinfer_mla

    for lib in (fla_kda, flash_prefill, flashinfer_mla):
        monkeypatch.setattr(lib, "available", lambda: True)
    bf16, f32 = torch.bfloat16, torch.float32
    k3 = OPS.describe(ServedShapes(bf16, bf16, f32, 8, 512, 64, 192, "sigmoid"))
    assert k3["mla"] == "triton+flashinfer-decode+torch-flash-prefill" and k3["kda"] == "triton+fla-prefill"
    narrow = OPS.describe(ServedShapes(bf16, bf16, f32, 2, 32, 16, 48, "sigmoid"))
    assert narrow["mla"] == "triton+torch-flash-prefill"
    fp32 = OPS.describe(ServedShapes(f32, f32, f32, 8, 512, 64, 192, "sigmoid"))
    assert fp32["mla"] == "triton" and fp32["kda"] == "triton"


def test_engine_over_bf16_states_counts_every_kda_decode(tmp_path, monkeypatch):
    from deltaserve import LLM
    from deltaserve.engine.request.sampling_params import SamplingParams
    from deltaserve.tiny import make_tiny

    monkeypatch.setenv("DELTASERVE_TRITON", "1")
    ckpt = make_tiny(tmp_path / "k3", "kimi_k3", "tiny", seed=0)
    llm = LLM(ckpt, "float32", max_num_seqs=2, kv_cache_memory=16 * 2**20, max_model_len=256, progress=False,
              kv_state_dtype="bfloat16", device=DEVICE)  # fmt: skip
    assert isinstance(llm.model.ops, TritonOps)
    before = fallbacks.snapshot()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 30))}], params)
    kda_layers = len(llm.model.config.kda_layer_ids)
    assert fallbacks.since(before) == {("kda_decode", "cache_dtype"): 2 * kda_layers}  # 2 steps after the prefill
