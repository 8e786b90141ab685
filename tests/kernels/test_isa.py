"""Selection of the kernels' instruction set at load (`DELTASERVE_ISA`, `build.choose_isa`): each
variant this CPU runs (avx2, avx512, amx), built and loaded on its own handle by `library.load(isa)`
(the process's `native()` is untouched), against the reference ops with the tolerances of
tests/ops/test_cpu_kernels.py and test_kda_native.py, and bit for bit the GEMV kernels' one summation
order per dot product (a row alone == its row of a batch, MXFP4 decoded on the fly == the decoded bf16
weights); and the engine on a tiny bf16 model with
`DELTASERVE_ISA=avx2` in a subprocess, its greedy tokens within bf16 noise of the reference.
Variants the CPU lacks are skipped; the selection logic itself is checked on simulated CPUs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltaserve.kernels.cpu import build
from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.ops import kda as K
from deltaserve.ops.activations import situ_and_mul
from deltaserve.ops.mla import lse_combine, mla_absorbed_attention
from deltaserve.ops.moe import grouped_experts
from deltaserve.ops.norms import rms_norm

from ..engine.test_native_decode import TIE
from ..ops.test_cpu_kernels import routed_case, ulps
from ..ops.test_flash_attention import case as flash_case
from ..ops.test_flash_attention import oracle as flash_oracle
from ..ops.test_kda_native import _close, _cu, _inputs
from ..ops.test_native_small_ops import _bf16_close

BF = torch.bfloat16
pytestmark = pytest.mark.skipif(build.find_compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module", params=build.ISAS)
def kernels(request):
    """The variant for one ISA, loaded on its own (skipped where the CPU or the OS lacks it)."""
    if request.param not in build.cpu_isas():
        pytest.skip(f"this CPU lacks {request.param}")
    k = cpu_kernels.load(request.param)
    if k.isa != request.param:
        pytest.skip(f"{request.param} built but not granted ({k.isa} runs; DELTASERVE_AMX=0?)")
    return k


def test_variant_has_exactly_its_isa(kernels):
    assert bool(kernels.lib.ds_has_avx512bf16()) == (kernels.isa != "avx2")
    assert bool(kernels.lib.ds_amx_ready()) == (kernels.isa == "amx")
    assert kernels.tile_kind == {"avx2": "none", "avx512": "avx512-bf16", "amx": "amx"}[kernels.isa]
    assert f"-{kernels.isa}-" in Path(kernels.lib._name).name


@pytest.mark.parametrize("rows", [1, 5, 8, 40])
def test_linear(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=gen).to(BF)
    w = torch.randn(300, 1024, generator=gen).to(BF)
    if rows > kernels.multi_rows(1024):
        pytest.skip("more rows than the GEMV kernels take (tile kernels only)")
    ref = F.linear(x, w)
    got = kernels.linear_bf16_multi(x, [w])[0]
    assert ulps(got, ref, ref) <= 2.0
    if rows <= cpu_kernels.MAX_ROWS:
        assert ulps(kernels.linear_bf16(x, w), ref, ref) <= 2.0


@pytest.mark.parametrize("k", [1000, 1008])
def test_linear_rows_alone_equal_the_batch(kernels, k):
    """K with a tail past the last 32-block (8, 16 elements): within 2 ulps of F.linear, and each row of a
    batch of up to 8 bit-identical to that row alone (the GEMV kernels sum each dot product in one order)."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(8, k, generator=gen).to(BF)
    w = torch.randn(77, k, generator=gen).to(BF)
    alone = torch.cat([kernels.linear_bf16(x[m : m + 1], w) for m in range(8)])
    assert ulps(alone, F.linear(x, w), F.linear(x, w)) <= 2.0
    for rows in range(2, 9):
        assert torch.equal(kernels.linear_bf16(x[:rows], w), alone[:rows])


@pytest.mark.parametrize("n,e,inter,d,k", [(8, 10, 96, 96, 7), (5, 3, 64, 2304, 2), (3, 2, 64, 4608, 2)])
def test_experts_packed_equal_dense_and_token_equal_batch(kernels, n, e, inter, d, k):
    """Every variant: MXFP4 decoded on the fly == the decoded bf16 weights, bit for bit, and (GEMV path,
    1..8 pairs an expert) a token alone == its row of the batch (tests/ops/test_cpu_kernels.py holds
    both for the process's own variant); wide inputs take the AVX2 kernels' chunked and heap paths."""
    (w1, w3, w2), dense, x, ids, wts = routed_case(n, torch.Generator().manual_seed(d), e=e, inter=inter, d=d, k=k)
    act = (cpu_kernels.ACT_SITU, 4.0, 25.0)
    ref = grouped_experts(x, ids, wts, *dense, lambda g, u: situ_and_mul(g, u, 4.0, 25.0))
    old = kernels.set_amx(False)
    try:
        batched = [kernels.moe_experts(x, ids, wts, *weights, *act) for weights in ((w1, w3, w2), dense)]
        assert torch.equal(batched[0], batched[1])
        assert ulps(batched[0], ref, ref) <= 2.0
        for t in range(x.shape[0]):
            one = kernels.moe_experts(x[t : t + 1], ids[t : t + 1], wts[t : t + 1], w1, w3, w2, *act)
            assert torch.equal(one, batched[0][t : t + 1])
    finally:
        kernels.set_amx(old)


def test_one_token_bf16_experts_of_odd_width(kernels):
    """bf16 experts (the shared experts' kind) whose width is no multiple of the row blocks: the batch-1
    kernel (moe_row.c) against the reference and, bit for bit, the batched GEMV path."""
    gen = torch.Generator().manual_seed(3)
    e, inter, d = 3, 100, 96
    w1, w3 = (torch.randn(e, inter, d, generator=gen).to(BF) * 0.1 for _ in range(2))
    w2 = torch.randn(e, d, inter, generator=gen).to(BF) * 0.1
    x, ids, wts = torch.randn(3, d, generator=gen).to(BF), torch.tensor([[0, 2], [2, 1], [1, 0]]), torch.rand(3, 2)
    act = (cpu_kernels.ACT_SITU, 4.0, 25.0)
    ref = grouped_experts(x, ids, wts, w1, w3, w2, lambda g, u: situ_and_mul(g, u, 4.0, 25.0))
    old = kernels.set_amx(False)
    try:
        batched = kernels.moe_experts(x, ids, wts, w1, w3, w2, *act)
        one = torch.cat(
            [kernels.moe_experts(x[t : t + 1], ids[t : t + 1], wts[t : t + 1], w1, w3, w2, *act) for t in range(3)]
        )
    finally:
        kernels.set_amx(old)
    assert torch.equal(one, batched) and ulps(one, ref, ref) <= 2.0


@pytest.mark.parametrize("n", [3, 40])
def test_moe_experts_dense_and_mxfp4(kernels, n):
    (w1, w3, w2), dense, x, ids, wts = routed_case(n, torch.Generator().manual_seed(n))
    ref = grouped_experts(x, ids, wts, *dense, lambda g, u: situ_and_mul(g, u, 4.0, 25.0))
    for weights in ((w1, w3, w2), dense):
        got = kernels.moe_experts(x, ids, wts, *weights, cpu_kernels.ACT_SITU, 4.0, 25.0)
        assert ulps(got, ref, ref) <= 2.0


@pytest.mark.parametrize("n,d", [(3, 40), (300, 1040)])
def test_rms_norm(kernels, n, d):
    gen = torch.Generator().manual_seed(d)
    x = (3 * torch.randn(n, d, generator=gen)).bfloat16()
    w = torch.randn(d, generator=gen)
    _bf16_close(kernels.rms_norm(x, w, 1e-5), rms_norm(x, w.bfloat16(), 1e-5))


@pytest.mark.parametrize("h,dk,dv", [(3, 24, 40), (1, 128, 128)])
def test_kda_chunked_prefill(kernels, h, dk, dv):
    lens = [1, 64, 130]
    q, k, v, g, beta, s0 = _inputs(lens, h, dk, dv, seed=dk)
    args = (q, k, v, g, beta, _cu(lens), dk**-0.5)
    o, s, _ = kernels.kda_chunked(*args, initial_state=s0)
    o_t, s_t, _ = K.kda_chunked(*args, initial_state=s0)
    _close(o, o_t)
    _close(s, s_t)


def test_mla_decode(kernels):
    gen = torch.Generator().manual_seed(5)
    heads, rank, rope, lens = 4, 64, 16, [1, 300, 700]
    pool = torch.randn(2048, rank + rope, generator=gen).to(BF)
    rows = torch.randperm(2048, generator=gen)[: sum(lens)]
    cu_kv = torch.tensor([0, *lens]).cumsum(0)
    q = torch.randn(len(lens), heads, rank + rope, generator=gen).to(BF)
    scale = (rank + rope) ** -0.5
    got = kernels.mla_decode(q, pool, rows, cu_kv, rank, scale)
    ref = mla_absorbed_attention(q, pool[rows], torch.arange(len(lens) + 1), cu_kv, rank, scale)
    assert ulps(got, ref, ref) <= 2.0
    # the partial form over two shares of each context (positions t % 2; the 1-row one has none in
    # the second), merged by LSE: the same attention
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()[:-1]]
    parts = []
    for share in range(2):
        pos = [torch.arange(share, n, 2) for n in lens]
        cu = torch.tensor([0, *[len(p) for p in pos]]).cumsum(0)
        parts.append(
            kernels.mla_decode_partial(q, pool, torch.cat([rows[s + p] for s, p in zip(starts, pos)]), cu, rank, scale)
        )
    assert torch.isinf(parts[1][1][0]).all()
    merged, _ = lse_combine(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert ulps(merged.to(BF), ref, ref) <= 2.0


def test_flash_attention_runs_where_avx512_bf16_does(kernels):
    """The prefill flash kernel: the oracle's values on AVX512-BF16 variants; the AVX2 variant declines
    (None: the caller runs SDPA)."""
    q, k_nope, k_rot, v, cu_q, cu_kv = flash_case([20, 70], [20, 150], 2, 16, 8, 16)
    got = kernels.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, 0.2)
    if kernels.isa == "avx2":
        assert got is None
        return
    ref = flash_oracle(q, k_nope, k_rot, v, [20, 70], [20, 150], 0.2)
    assert float((got.double() - ref).abs().max()) <= 2**-6


_AVX2 = "flags\t: fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe abm"
_SPR = _AVX2 + " avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize(
    "flags, requested, chosen, warns",
    [
        (_SPR, None, "amx", False),
        (_SPR, "avx2", "avx2", False),
        (_SPR, "avx512", "avx512", False),
        (_AVX2, "", "avx2", False),
        (_AVX2, "amx", "avx2", True),
        (_AVX2, "sse9", "avx2", True),
        ("flags\t: fp asimd", "avx512", "generic", True),
        ("", None, "generic", False),
    ],
)
def test_choose_isa_refuses_what_the_cpu_lacks(monkeypatch, caplog, flags, requested, chosen, warns):
    monkeypatch.setattr(build, "_cpu_flags", lambda: flags)
    with caplog.at_level(logging.WARNING, logger=build.log.name):
        assert build.choose_isa(requested) == chosen
    assert ("DELTASERVE_ISA" in caplog.text) == warns


def test_isa_flags(monkeypatch):
    assert "-march=x86-64-v3" in build.isa_flags("avx2") and not any("512" in f for f in build.isa_flags("avx2"))
    monkeypatch.setattr(build, "_cpu_flags", lambda: _SPR)
    assert "-mno-amx-tile" in build.isa_flags("avx512") and "-mno-amx-tile" not in build.isa_flags("amx")


_ENGINE = """
import json, logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from deltaserve import LLM, SamplingParams
from deltaserve.tiny import make_tiny
from deltaserve.ops.backends.select import describe
from tests.engine.test_native_decode import gaps_to_oracle
llm = LLM(make_tiny(sys.argv[1], "kimi_k3", mxfp4=True, seed=4), dtype="bfloat16", max_num_seqs=2, page_size=4,
          kv_cache_memory=32 * 2**20, max_model_len=128, progress=False)
prompts = [list(range(300, 321)), list(range(700, 705))]
outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
toks = [o.outputs[0].token_ids for o in outs]
print(json.dumps({"describe": describe(llm.model.ops), "isa": llm.model.ops.k.isa,
                  "gaps": [max(gaps_to_oracle(llm, p, t)) for p, t in zip(prompts, toks)],
                  "reversed": max(gaps_to_oracle(llm, prompts[0], toks[0][::-1]))}))
"""


def test_engine_on_avx2_within_bf16_noise_of_reference(tmp_path):
    if "avx2" not in build.cpu_isas():
        pytest.skip("this CPU lacks avx2")
    env = {**os.environ, "DELTASERVE_ISA": "avx2", "DELTASERVE_NATIVE": "1"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", _ENGINE, str(tmp_path / "k3")], cwd=root, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["isa"] == "avx2" and "cpu-native (avx2)" in out["describe"]
    assert "kernel backend: cpu-native" in run.stderr and "cpu-native (avx2): linear" in run.stderr
    assert max(out["gaps"]) < TIE
    assert out["reversed"] > 10 * TIE  # the check can fail
