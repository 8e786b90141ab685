"""The proxy's prefill choice, without servers: each prefill instance's `/disagg/match` reply
(device joint hit, host and disk resumable lengths) is weighed by the data-parallel router's tier
weights minus load, the reason counted; an older reply without the tier fields decodes as
holding nothing below the device."""

import asyncio

import msgspec
import pytest

from deltaserve.disagg.protocol import MatchReply, decode
from deltaserve.engine.dp.routing import LOAD_WEIGHT, TIER_WEIGHT
from deltaserve.proxy import Proxy, choose_prefill


def reply(device=0, host=0, disk=0, n=100) -> MatchReply:
    return MatchReply(n, device, device, 0, host_tokens=host, disk_tokens=disk)


@pytest.mark.parametrize(
    ("replies", "loads", "want"),
    [
        ([reply(device=40), reply(disk=90)], [0, 0], (1, "resume_disk", 90)),  # 0.5 * 0.9 > 0.4
        ([reply(device=60), reply(host=70)], [0, 0], (0, "resume_device", 60)),  # 0.6 > 0.75 * 0.7
        ([reply(device=30, host=80), reply()], [0, 0], (0, "resume_host", 80)),  # 0.6 > 0.3
        ([reply(device=10), reply()], [3, 0], (1, "load", 0)),  # 0.1 - 0.3 < 0
        ([reply(host=50), None], [0, 0], (0, "resume_host", 50)),  # one did not answer
        ([None, None], [2, 1], (1, "load", 0)),
        ([reply(), reply()], [0, 0], (0, "load", 0)),  # equals: the lower index
    ],
)
def test_choose_prefill_weighs_tiers_minus_load(replies, loads, want):
    assert choose_prefill(replies, loads) == want


def test_the_weights_are_the_routers():
    """The choice follows `TIER_WEIGHT` and `LOAD_WEIGHT` exactly: a disk resume of k tokens
    beats a device one of j iff its weighted fraction, less the load gap, is higher."""
    for k in range(0, 101, 5):
        dev = TIER_WEIGHT[0] * 50 / 100 - LOAD_WEIGHT * 1
        disk = TIER_WEIGHT[2] * k / 100
        got = choose_prefill([reply(device=50), reply(disk=k)], [1, 0])[0]
        assert got == (1 if disk >= dev else 0), k


def test_pick_prefill_counts_the_reason(monkeypatch):
    px = Proxy(["http://p0", "http://p1"], ["http://d"], "s")
    answers = {"http://p0": reply(device=20), "http://p1": reply(disk=80)}

    async def fake_match(url, path, body):
        return answers[url]

    monkeypatch.setattr(px, "_match", fake_match)
    assert asyncio.run(px.pick_prefill("/v1/completions", {})) == "http://p1"
    assert px.counters["prefill_routed_resume_disk"] == 1 and px.counters["prefill_joint_hit_tokens"] == 80


def test_an_older_reply_decodes_without_tiers():
    old = msgspec.msgpack.encode({"num_tokens": 9, "joint_tokens": 8, "mla_tokens": 8, "load": 1})
    assert decode(old, MatchReply) == MatchReply(9, 8, 8, 1, 0, 0)
