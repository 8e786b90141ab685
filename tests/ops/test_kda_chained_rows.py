"""`ds_kda_decode` chains adjacent rows that share a KDA slot (a speculative verify's tokens of one
sequence run as decode rows, engine/exec/chained_verify.py): the rows equal that many one-row
decode calls in order, bit for bit, with several threads too (the threads then split the heads;
the (row, head) split raced on a shared slot: seen only with the threads on separate cores)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.cpu import library as cpu_kernels

NK = cpu_kernels.native()
BF = torch.bfloat16


def _call(rows, slots, tails, states, w):
    q, k, v, f, gate, b = rows
    dk = states.shape[2]
    conv_w, a_log, dt_bias, norm_w = w
    return NK.kda_decode(
        q,
        k,
        v,
        conv_w,
        tails,
        states,
        slots,
        f,
        a_log,
        dt_bias,
        cpu_kernels.GATE_SIGMOID,
        -5.0,
        b,
        gate,
        norm_w,
        1e-5,
        dk**-0.5,
    )


@pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable (no C compiler)")
@pytest.mark.parametrize("threads", [1, 2])
def test_adjacent_rows_on_one_slot_equal_sequential_decode_steps(threads):
    gen = torch.Generator().manual_seed(7)
    heads, dk, width, num_slots = 4, 32, 4, 4
    p = heads * dk
    slots = torch.tensor([2, 2, 2, 2, 2, 0, 0, 3])  # runs of 5 and 2 (a verify each), one plain row

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    n = slots.numel()
    rows = [rnd(n, p).to(BF) for _ in range(5)] + [rnd(n, heads).to(BF)]
    w = (rnd(3 * p, width) * 0.5, rnd(heads) * 0.3, rnd(p) * 0.3, 1 + 0.1 * rnd(dk))
    tails, states = rnd(num_slots, width - 1, 3 * p).to(BF), rnd(num_slots, heads, dk, dk) * 0.1
    ref_tails, ref_states, first = tails.clone(), states.clone(), states.clone()
    one = [_call([r[i : i + 1] for r in rows], slots[i : i + 1], ref_tails, ref_states, w) for i in range(n)]
    want = torch.cat(one)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _call(rows, slots, tails, states, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert torch.equal(tails, ref_tails) and torch.equal(states, ref_states)
    assert not torch.equal(states[2], first[2]) and torch.equal(states[1], first[1])


@pytest.mark.skipif(NK is None, reason="native CPU kernels unavailable (no C compiler)")
def test_replay_of_recorded_rows_equals_a_block_step_of_those_rows():
    """`kda_block`'s record of a step's rows, replayed for some of them (`kda_replay`, what a
    speculative verify's fold does for its verified rows) from the state before the step, leaves
    the tails and states a `kda_block` of those rows alone leaves, bit for bit."""
    from deltaserve.kernels.cpu.blocks import KdaBlockWeights, kda_record_width

    gen = torch.Generator().manual_seed(3)
    heads, dk, width, d, num_slots = 4, 32, 4, 64, 4
    p = heads * dk

    def rnd(*s, scale=0.1, dtype=BF):
        return (torch.randn(*s, generator=gen) * scale).to(dtype)

    w = KdaBlockWeights(
        *(rnd(p, d) for _ in range(3)),
        rnd(dk, d),
        rnd(p, dk),
        rnd(heads, d),
        rnd(p, d),
        None,
        rnd(d, p),
        conv_w=rnd(3 * p, width, scale=0.5, dtype=torch.float32),
        a_log=rnd(heads, scale=0.3, dtype=torch.float32),
        dt_bias=rnd(p, scale=0.3, dtype=torch.float32),
        norm_w=1 + rnd(dk, dtype=torch.float32),
    )
    plan = NK.kda_block_plan(w, heads, cpu_kernels.GATE_SIGMOID, -5.0, 1e-5, dk**-0.5)
    slots = torch.tensor([2, 2, 2, 0, 0, 3])
    x = rnd(slots.numel(), d, scale=1.0)
    tails, states = rnd(num_slots, width - 1, 3 * p, scale=1.0), rnd(num_slots, heads, dk, dk, dtype=torch.float32)
    record = torch.empty(slots.numel() * kda_record_width(plan), dtype=BF)
    step = tails.clone(), states.clone()
    NK.kda_block(plan, x, *step, slots, record)
    keep = torch.tensor([0, 1, 3])  # the first two rows of slot 2's run, the first of slot 0's
    want = tails.clone(), states.clone()
    NK.kda_block(plan, x[keep], *want, slots[keep])
    got = tails.clone(), states.clone()
    NK.kda_replay([(plan, record, *got)], slots.numel(), keep, slots[keep])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[1][2], states[2]) and not torch.equal(got[1][2], step[1][2])
