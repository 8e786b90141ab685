"""The native flash-attention kernel (`ds_flash_attention`: MLA prefill, unabsorbed and absorbed)
against a float64 oracle written out here (or `naive_mla_absorbed_attention`), and against the
PyTorch path it replaces (`ops.mla`'s SDPA)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.cpu import library as cpu_kernels
from deltaserve.ops import mla
from deltaserve.ops.backends.cpu import CpuNativeOps
from deltaserve.ops.reference.dense import naive_mla_absorbed_attention

NK = cpu_kernels.native()
needs_flash = pytest.mark.skipif(NK is None or not NK.avx512_bf16, reason="needs the AVX512-BF16 kernels")
BF = torch.bfloat16


def oracle(q, k_nope, k_rot, v, ns, cs, scale):
    """float64, per sequence and head: query i of n over c rows sees rows [0, c - n + i]."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    qa = ka = 0
    for n, c in zip(ns, cs):
        keys = torch.cat([k_nope[ka : ka + c], k_rot[ka : ka + c, None].expand(c, q.shape[1], -1)], -1).double()
        seen = torch.arange(c)[None, :] <= (c - n + torch.arange(n))[:, None]
        for h in range(q.shape[1]):
            s = (q[qa : qa + n, h].double() @ keys[:, h].T * scale).masked_fill(~seen, float("-inf"))
            out[qa : qa + n, h] = torch.softmax(s, -1) @ v[ka : ka + c, h].double()
        qa, ka = qa + n, ka + c
    return out


def case(ns, cs, heads, dn, dr, dv, seed=0):
    """bf16 q [Nq, H, dn + dr]; k_nope and v as views of one kv_b output [Nkv, H, dn + dv] (the model's
    layout); k_rot [Nkv, dr]; cu_q, cu_kv."""
    gen = torch.Generator().manual_seed(seed)
    nq, nkv = sum(ns), sum(cs)
    q = torch.randn(nq, heads, dn + dr, generator=gen).to(BF)
    kv = torch.randn(nkv, heads, dn + dv, generator=gen).to(BF)
    k_rot = torch.randn(nkv, dr, generator=gen).to(BF)
    cu = [torch.tensor([0, *x]).cumsum(0) for x in (ns, cs)]
    return q, kv[..., :dn], k_rot, kv[..., dn:], *cu


def max_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


@needs_flash
@pytest.mark.parametrize(
    "ns, cs, heads, dn, dr, dv",
    [
        ([5], [5], 2, 16, 8, 16),  # one square prompt, one partial tile
        ([200], [200], 3, 128, 64, 128),  # K3's head dims: several key blocks, query blocks and tiles
        ([70], [333], 2, 16, 8, 16),  # a chunk over a cached context
        ([1, 0, 130, 7], [3, 10, 300, 7], 2, 16, 8, 16),  # packed: a decode row, no queries, a chunk, a prompt
        ([33], [97], 2, 15, 6, 20),  # odd key width, values not a multiple of 16
        ([40], [90], 1, 32, 0, 48),  # no shared rope part
    ],
)
def test_flash_attention_matches_oracle_and_sdpa(ns, cs, heads, dn, dr, dv):
    q, k_nope, k_rot, v, cu_q, cu_kv = case(ns, cs, heads, dn, dr, dv)
    scale = (dn + dr) ** -0.5
    got = NK.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, scale)
    ref = oracle(q, k_nope, k_rot, v, ns, cs, scale)
    sdpa = mla.mla_context_attention(q, mla.joined_keys(k_nope, k_rot), v.contiguous(), cu_q, cu_kv, scale)
    assert got.shape == (sum(ns), heads, dv) and got.dtype == BF
    # both round the output to bf16 (and ours the probabilities): within a few bf16 ulps of outputs ~ 1
    assert max_err(got, ref) <= 2 * max_err(sdpa, ref) + 2**-8
    assert max_err(got, sdpa) <= 2**-5


@needs_flash
def test_packing_modes_agree():
    """A sequence of >= 8 tasks a head (8 x 96 query rows) has its blocks packed ahead, the others' tasks
    pack what they read; with a budget of one head's blocks the heads are packed in turns, with none
    nothing is packed ahead: the same values bit for bit, the oracle's."""
    ns, cs, heads, dn, dr, dv = [800, 30], [900, 40], 3, 16, 8, 20
    q, k_nope, k_rot, v, cu_q, cu_kv = case(ns, cs, heads, dn, dr, dv, seed=4)
    got = NK.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, 0.2)
    assert max_err(got, oracle(q, k_nope, k_rot, v, ns, cs, 0.2)) <= 2**-6
    blocks = (900 + 63) // 64  # the long sequence's 64-row blocks: keys [pairs][64], values [32 pairs][Dv to 16]
    one_head = 4 * blocks * ((dn + dr + 1) // 2 * 64 + 32 * ((dv + 15) // 16 * 16))
    for budget in (one_head, 1):
        assert torch.equal(NK.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, 0.2, pack_bytes=budget), got)


@needs_flash
def test_flash_attention_first_query_returns_its_row():
    """Query 0 of a prompt sees row 0 alone: its weight is exactly 1, its output that value row."""
    q, k_nope, k_rot, v, cu_q, cu_kv = case([9], [9], 2, 16, 8, 16, seed=3)
    got = NK.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, 0.1)
    assert torch.equal(got[0], v[0])


@needs_flash
def test_flash_attention_rejects_bad_operands():
    q, k_nope, k_rot, v, cu_q, cu_kv = case([6], [4], 2, 16, 8, 16)
    with pytest.raises(ValueError, match="as many rows"):
        NK.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, 1.0)
    q, k_nope, k_rot, v, cu_q, cu_kv = case([4], [6], 2, 16, 8, 16)
    with pytest.raises(ValueError, match="span"):
        NK.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv - 1, 1.0)
    with pytest.raises(ValueError, match="disagree"):
        NK.flash_attention(q.float(), k_nope, k_rot, v, cu_q, cu_kv, 1.0)


@needs_flash
def test_native_ops_take_the_kernel_for_both_prefill_forms(monkeypatch):
    """`CpuNativeOps.mla_prefill` / `mla_context_prefill` call the kernel on bf16 (values as SDPA's),
    and fall back to the PyTorch path where it declines."""
    ops = CpuNativeOps(NK)
    calls = []
    real = NK.flash_attention
    monkeypatch.setattr(NK, "flash_attention", lambda *a: calls.append(a) or real(*a))
    q, k_nope, k_rot, v, cu_q, cu_kv = case([30, 12], [50, 12], 2, 16, 8, 16)
    scale = 24**-0.5
    keys = mla.joined_keys(k_nope, k_rot)
    ctx = ops.mla_context_prefill(q, k_nope, k_rot, v, cu_q, cu_kv, scale)
    assert max_err(ctx, mla.mla_context_attention(q, keys, v.contiguous(), cu_q, cu_kv, scale)) <= 2**-5
    sq = case([30, 12], [30, 12], 2, 16, 8, 16)
    sq_out = ops.mla_prefill(*sq[:4], sq[4], 24**-0.5)
    ref = mla.mla_prefill_attention(sq[0], mla.joined_keys(sq[1], sq[2]), sq[3].contiguous(), sq[4], 24**-0.5)
    assert max_err(sq_out, ref) <= 2**-5 and len(calls) == 2
    monkeypatch.setattr(NK, "flash_attention", lambda *a: None)  # as a build without AVX512-BF16
    assert torch.equal(
        ops.mla_context_prefill(q, k_nope, k_rot, v, cu_q, cu_kv, scale),
        mla.mla_context_attention(q, keys, v.contiguous(), cu_q, cu_kv, scale),
    )


@needs_flash
def test_decompressed_rows_hold_less_on_the_kernel():
    """What the unabsorbed cap counts a context row: the kv_b output alone on the kernel (4 KiB at 8 of
    K3's heads), SDPA's joined keys and padded values too (10 KiB) where the kernel is off."""
    from deltaserve.ops.backends.torch import REFERENCE

    sizes = dict(heads=8, rope=64, nope=128, v=128)
    assert CpuNativeOps(NK).unabsorbed_row_bytes(**sizes) == 8 * 2 * 256
    assert (
        CpuNativeOps(NK, flash_prefill=False).unabsorbed_row_bytes(**sizes)
        == REFERENCE.unabsorbed_row_bytes(**sizes)
        == 8 * 2 * (256 + 2 * 192)
    )


@needs_flash
def test_flash_prefill_switch(monkeypatch):
    """`DELTASERVE_FLASH_PREFILL=0` keeps the native backend's MLA prefill on SDPA."""
    from deltaserve.ops.backends.select import select_ops

    q, k_nope, k_rot, v, cu_q, cu_kv = case([8], [8], 2, 16, 8, 16)
    assert select_ops("cpu", BF)._flash(q, k_nope, k_rot, v, cu_q, cu_kv, 0.2) is not None
    monkeypatch.setenv("DELTASERVE_FLASH_PREFILL", "0")
    ops = select_ops("cpu", BF)
    assert not ops.flash_prefill and ops._flash(q, k_nope, k_rot, v, cu_q, cu_kv, 0.2) is None


@needs_flash
@pytest.mark.parametrize(
    "ns, cs, heads, rank, rope",
    [
        ([3, 1, 0, 7], [10, 5, 4, 300], 2, 32, 8),  # chunks, a decode row, no queries
        ([1, 1], [1, 64], 4, 64, 16),
        ([20], [150], 8, 512, 64),  # K3's latent widths, heads folded into 160 query rows
    ],
)
def test_absorbed_form_on_the_kernel(ns, cs, heads, rank, rope):
    """`CpuNativeOps.mla_absorbed`: the kernel as MQA (one key head: the latent rows read in place; the
    query heads folded into rows, group = heads) against the float64 oracle and SDPA."""
    gen = torch.Generator().manual_seed(len(ns) * heads)
    q = torch.randn(sum(ns), heads, rank + rope, generator=gen).to(BF)
    rows = torch.randn(sum(cs), rank + rope, generator=gen).to(BF)
    cu_q, cu_kv = (torch.tensor([0, *x]).cumsum(0) for x in (ns, cs))
    scale = (rank + rope) ** -0.5
    got = CpuNativeOps(NK).mla_absorbed(q, rows, cu_q, cu_kv, rank, scale)
    ref = naive_mla_absorbed_attention(q.double(), rows.double(), cu_q, cu_kv, rank, scale)
    sdpa = mla.mla_absorbed_attention(q, rows, cu_q, cu_kv, rank, scale)
    assert got.shape == (sum(ns), heads, rank)
    assert max_err(got, ref) <= 2 * max_err(sdpa, ref) + 2**-8
    latent = rows[:, None, :rank]  # the kernel ran (not SDPA's fallback): its own call's values
    direct = NK.flash_attention(q.view(-1, 1, rank + rope), latent, rows[:, rank:], latent, cu_q, cu_kv, scale, heads)
    assert torch.equal(got, direct.view_as(got))
    with pytest.raises(ValueError, match="span"):  # cu_q counts positions: group rows each
        NK.flash_attention(
            q.view(-1, 1, rank + rope),
            rows[:, None, :rank],
            rows[:, rank:],
            rows[:, None, :rank],
            cu_q,
            cu_kv,
            scale,
            group=heads + 1,
        )


@needs_flash
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ns, cs", [([90], [90]), ([40], [700])])
def test_key_spans_merge(threads, ns, cs):
    """Fewer tasks than 2 x threads: each task's key blocks are split into spans whose partials merge by
    their maxima (one task here: 2 x threads spans; in the prompt, empty ones and ones past the first
    rows' keys); the oracle's values."""
    q, k_nope, k_rot, v, cu_q, cu_kv = case(ns, cs, 1, 16, 8, 16, seed=6)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = NK.flash_attention(q, k_nope, k_rot, v, cu_q, cu_kv, 0.2)
    finally:
        torch.set_num_threads(old)
    ref = oracle(q, k_nope, k_rot, v, ns, cs, 0.2)
    sdpa = mla.mla_context_attention(q, mla.joined_keys(k_nope, k_rot), v.contiguous(), cu_q, cu_kv, 0.2)
    assert max_err(got, ref) <= 2 * max_err(sdpa, ref) + 2**-8


@needs_flash
def test_bench_script_runs(monkeypatch, capsys):
    """scripts/cpu_attention_bench.py (the docs' tables) on tiny shapes: one JSON row a form."""
    import json
    import runpy
    from pathlib import Path

    script = Path(__file__).parents[2] / "scripts" / "cpu_attention_bench.py"
    argv = ["x", "--shapes", "40x70", "--absorbed", "3x50", "--heads", "2", "--rank", "32", "--reps", "1", "--json"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["form"], r["queries"], r["rows"]) for r in rows] == [("unabsorbed", 40, 70), ("absorbed", 3, 50)]
    assert all(r["ours_ms"] > 0 and r["sdpa_ms"] > 0 for r in rows)
