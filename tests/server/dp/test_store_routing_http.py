"""Two replicas behind the `serve --data-parallel-size 2` front, sharing one Mooncake Store
(`--kv-store`, a real `mooncake_master`; the objects live in a storage segment this test lends, as
a storage node would): a session's next turn lands on the replica holding its prefix (routed
`resume_device`, a prefix hit there), and a next turn the other replica must take (its session is
pinned there by `prompt_cache_key`) resumes the prefix from the shared store (a store-tier hit
there: the whole prefix hit came from it); and when the replica holding a session's latest turn is
killed, the next turn goes to the other one, which resumes the rest of the prefix from the store.
Every answer is the greedy answer of an engine with the prefix cache off."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.cache.tiers.mooncake import MooncakeClient
from deltaserve.engine.dp.routing import rendezvous_among
from deltaserve.replica_front import routing_key
from deltaserve.tiny import make_tiny
from tests.engine.mooncake_master import Master, master_binary
from tests.server.dp.test_data_parallel import _routed, _until
from tests.server.dp.test_resume_routing_http import _metric, _replica, dp_front

MAX_TOKENS = 6
UNIT = 16  # dp_front's --prefix-match-unit


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dps") / "k3", family="kimi_k3", preset="tiny", seed=5)


@pytest.fixture
def store(tmp_path):
    """A master and a client lending the store its only segment (the replicas lend none, so what
    they write outlives either of them)."""
    master_binary()
    master = Master(tmp_path / "master.log")
    try:
        holder = MooncakeClient(master.url, 64 << 20)
    except BaseException:
        master.stop()
        raise
    yield master.url
    holder.close()
    master.stop()


def _tier(base: str, i: int, name: str, tier: str = "store") -> float:
    text = httpx.get(f"{base}/replicas/{i}/metrics", timeout=10).text
    m = re.search(rf'^deltaserve:{name}(?:_total)?{{[^}}]*tier="{tier}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(base: str, ids: list[int], **extra) -> str:
    body = {"model": "k3", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body | extra, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _homed(prefix: list[int], home: int, want: bool, salt: int) -> list[int]:
    """`prefix` plus a few tokens, such that its prompt-start rendezvous replica is `home` (want)
    or is not (not want): where the fallback routing alone would send it."""
    for j in range(64):
        ids = prefix + [100 + salt, 200 + j, 300 + salt]
        if (rendezvous_among(routing_key({"prompt": ids}), [0, 1]) == home) == want:
            return ids
    raise AssertionError("no such continuation")


def cache_off(model) -> tuple:
    """(the oracle: prompt ids -> the greedy text of an fp32 engine with the prefix cache off,
    its tokenizer)."""
    off = LLM(model, dtype="float32", enable_prefix_caching=False, progress=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return (lambda ids: off.generate([ids], greedy, use_tqdm=False)[0].outputs[0].text), off.tokenizer


def test_a_next_turn_resumes_where_its_prefix_is_or_from_the_shared_store(model, store):
    oracle, tok = cache_off(model)
    turn1 = tok.encode("You are a careful assistant who answers questions about the sea. " * 5)
    assert len(turn1) >= 4 * UNIT
    flags = ["--dtype", "float32", "--no-channel-guard", "--kv-offload-memory", "16MiB", "--kv-store", store]
    with dp_front(model, *flags, start_s=240) as (base, output, pids):
        assert _complete(base, turn1) == oracle(turn1)
        home = [i for i, n in enumerate(_routed(base)) if n][0]
        other = 1 - home
        _until(lambda: _tier(base, home, "prefix_cache_tier_objects") > 0, 60, "".join(output[-30:]))
        _until(lambda: _metric(base, "dp_route_boundaries", f'replica="{home}"') > 0, 30, "".join(output[-30:]))
        turn2 = lands_where_its_prefix_is(base, home, turn1, oracle)
        resumes_from_the_store_elsewhere(base, other, turn1, oracle)
        survives_its_holder(base, pids, home, turn2, oracle, output)


def lands_where_its_prefix_is(base: str, home: int, turn1: list[int], oracle) -> list[int]:
    """The next turn, whose prompt start hashes to the other replica, goes where turn 1 resumes;
    it is two units longer, so its own checkpoint object goes to the store too."""
    written = _tier(base, home, "prefix_cache_tier_objects")
    turn2 = _homed(turn1 + list(range(500, 500 + 2 * UNIT)), home, False, 1)
    hits = _replica(base, home, "prefix_cache_hit_tokens_total")
    resumed = _metric(base, "dp_route_decisions_total", 'reason="resume_device"')
    assert _complete(base, turn2) == oracle(turn2)
    assert _routed(base)[home] == 2
    assert _metric(base, "dp_route_decisions_total", 'reason="resume_device"') == resumed + 1
    assert _replica(base, home, "prefix_cache_hit_tokens_total") - hits >= 4 * UNIT
    _until(lambda: _tier(base, home, "prefix_cache_tier_objects") > written, 60, "turn 2 not in the store")
    return turn2


def resumes_from_the_store_elsewhere(base: str, other: int, turn1: list[int], oracle) -> None:
    """A session pinned on the other replica sends a next turn of turn 1: it resumes there from
    the store (the other replica's device and host tiers never held it)."""
    pin = _homed([7, 8, 9], other, True, 2)  # an unrelated first request: the fallback routes it
    assert _complete(base, pin, prompt_cache_key="agent-b") == oracle(pin)
    assert _routed(base)[other] == 1
    turn2 = _homed(turn1 + [21, 22], other, False, 3)
    hits = _replica(base, other, "prefix_cache_hit_tokens_total")
    assert _complete(base, turn2, prompt_cache_key="agent-b") == oracle(turn2)
    assert _routed(base)[other] == 2
    assert _metric(base, "dp_route_decisions_total", 'reason="affinity"') >= 1
    assert _tier(base, other, "prefix_cache_tier_hits") == 1
    restored = _tier(base, other, "prefix_cache_tier_hit_tokens")
    assert restored >= 4 * UNIT and restored % UNIT == 0, restored
    assert _replica(base, other, "prefix_cache_hit_tokens_total") - hits == restored  # all of it from the store
    assert _tier(base, other, "prefix_cache_tier_bytes_read") > 0


def survives_its_holder(base: str, pids: list[int], home: int, turn2: list[int], oracle, output) -> None:
    """SIGKILL the replica that computed turn 2: the front forgets it, and turn 3 goes to the
    other replica (which resumes turn 1 on its device), which restores the rest of turn 2's
    prefix from the store."""
    other = 1 - home
    os.kill(pids[home], signal.SIGKILL)
    _until(lambda: _metric(base, "dp_route_boundaries", f'replica="{home}"') == 0, 30, "".join(output[-30:]))
    hits, restored = _tier(base, other, "prefix_cache_tier_hits"), _tier(base, other, "prefix_cache_tier_hit_tokens")
    turn3 = turn2 + [31, 32, 33]
    assert _complete(base, turn3) == oracle(turn3)
    assert _routed(base)[other] == 3
    assert _tier(base, other, "prefix_cache_tier_hits") == hits + 1
    assert _tier(base, other, "prefix_cache_tier_hit_tokens") - restored >= UNIT
