"""The shared tier (`--kv-store mooncake://HOST:PORT`) over a real `mooncake_master`: a fresh
engine with empty device, host and disk tiers resumes a prefix another engine computed (greedy
tokens equal to the cache off, the hit counted for tier 'store', fewer tokens computed); a
corrupted, foreign or torn object in the store is a counted miss and the answer stays the same;
a master that goes away mid-run costs misses, never a crash or a wrong token."""

import random
import subprocess
import sys
import time

import pytest
from safetensors.torch import load

from deltaserve import SamplingParams
from deltaserve.cache.tiers.mooncake import MooncakeClient, StoreUnavailable
from deltaserve.cache.tiers.objects import Meta, TierObject, encode, read_header
from deltaserve.server.metrics import tier_metrics
from deltaserve.tiny import make_tiny

from .mooncake_master import Master, free_port, master_binary
from .sched.test_cache_pressure import assert_all_free
from .test_prefix_cache import make

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMALL = dict(num_pages=30, num_ckpt_slots=3, max_num_seqs=2, max_num_batched_tokens=24)


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def ckpt(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), family=request.param, preset="tiny", seed=21)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The failure cases run on one family (a gone master costs the client's RPC timeouts)."""
    return make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=21)


@pytest.fixture
def master(tmp_path):
    master_binary()
    m = Master(tmp_path / "master.log")
    yield m
    m.stop()


def tiers(llm) -> dict:
    return llm.stats()["prefix_cache"]["tiers"]


def prompts(llm, seed: int) -> tuple[list[int], list[int]]:
    """A long prompt and the next turn that extends it."""
    rng = random.Random(seed)
    vocab = llm.model.config.vocab_size
    p = [rng.randrange(vocab) for _ in range(90)]
    return p, p + [rng.randrange(vocab) for _ in range(9)]


def answer(llm, p: list[int]) -> list[int]:
    return llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def writer(ckpt, url: str):
    """Engine A: computes the long prompt and writes its objects to the store (lends the memory)."""
    a = make(ckpt, True, **SMALL, kv_store=url, kv_store_size="64MiB")
    p, q = prompts(a, 5)
    answer(a, p)
    a.cache.tier.flush()
    assert tiers(a)["store"]["objects_written"] > 0, tiers(a)
    return a, p, q


def test_a_fresh_engine_resumes_a_prefix_another_one_computed(ckpt, master):
    a, p, q = writer(ckpt, master.url)
    off = make(ckpt, False, **SMALL)
    b = make(ckpt, True, **SMALL, kv_store=master.url, kv_offload_memory="16MiB")  # lends nothing
    assert answer(b, q) == answer(off, q)
    store, pc = tiers(b)["store"], b.stats()["prefix_cache"]
    assert store["hits"] == 1 and store["hit_tokens"] == 88 and store["bytes_read"] > 0, store
    assert pc["hits"] == 1 and pc["hit_tokens"] == 88, pc
    assert b.stats()["computed_tokens"] == len(q) - 88 + GREEDY.max_tokens - 1
    assert not any(k.startswith("verify_miss") for k in store), store
    families = {m.name: m for m in tier_metrics(tiers(b), "m", pc["hits"])}
    got = {s.labels["tier"]: s.value for s in families["deltaserve:prefix_cache_tier_hits"].samples}
    assert got == {"device": 0, "host": 0, "store": 1}, got
    lat = [s for s in families["deltaserve:prefix_cache_tier_restore_seconds"].samples if s.labels["tier"] == "store"]
    assert [s.value for s in lat if s.name.endswith("_count")] == [1] and lat[-1].value > 0, lat
    # the restored objects went up to B's host tier: after the device drops them, host serves them
    assert b.reset_prefix_cache()
    assert answer(b, q) == answer(off, q)
    assert tiers(b)["host"]["hits"] == 1 and tiers(b)["store"]["hits"] == 1, tiers(b)
    assert_all_free(b)
    b.shutdown()
    a.shutdown()


def _flip(data: bytes, fp: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x40])


def _foreign(data: bytes, fp: bytes) -> bytes:
    """The same object, intact and digested, under another model's fingerprint."""
    meta, _, _ = read_header(data, len(data))
    t = load(data)
    obj = TierObject(Meta(meta.key, meta.parent, meta.start, meta.end, 0), t["mla"], t["tails"], t["states"])
    return encode(obj, bytes(32))


def _torn(data: bytes, fp: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize(("damage", "reason"), [(_flip, "digest"), (_foreign, "fingerprint"), (_torn, "torn")])
def test_a_damaged_object_in_the_store_is_a_counted_miss(k3, master, damage, reason):
    ckpt = k3
    a, p, q = writer(ckpt, master.url)
    off = make(ckpt, False, **SMALL)
    shared = a.cache.tier.store
    raw = MooncakeClient(master.url)
    keys = [shared.key(k) for k in list(shared.index)]
    for key in keys:
        data = raw.get(key)
        assert raw.remove(key) == 0 and raw.put(key, damage(data, shared.fingerprint)) == 0
    b = make(ckpt, True, **SMALL, kv_store=master.url)
    assert answer(b, q) == answer(off, q)
    store = tiers(b)["store"]
    assert store[f"verify_miss_{reason}"] > 0 and store["hits"] == 0, store
    assert b.stats()["prefix_cache"]["hit_tokens"] == 0
    assert all(raw.get(key) is None for key in keys), "the refused objects left the store"
    raw.close()
    b.shutdown()
    a.shutdown()


HOLD = """
import sys, time
from deltaserve.cache.tiers.mooncake import MooncakeClient
client = MooncakeClient(sys.argv[1], 64 << 20)
print("lent", flush=True)
time.sleep(600)
"""


def test_an_object_on_a_dead_instance_segment_is_a_miss_not_an_outage(k3, master):
    """The objects sit in the segment of an instance killed a moment ago (the master lists them
    until its lease ends, their bytes are gone): reading one is a counted miss (`unreadable`),
    not a store outage that would skip the store and drop every write for `backoff_s`."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, master.url], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "lent"
        a = make(k3, True, **SMALL, kv_store=master.url)  # lends nothing: the objects go to the holder
        p, q = prompts(a, 5)
        answer(a, p)
        a.cache.tier.flush()
        assert tiers(a)["store"]["objects_written"] > 0, tiers(a)
        off = make(k3, False, **SMALL)
        b = make(k3, True, **SMALL, kv_store=master.url)
    finally:
        holder.kill()
        holder.wait()
    assert answer(b, q) == answer(off, q)
    store = tiers(b)["store"]
    assert store.get("verify_miss_unreadable", 0) > 0 and store["hits"] == 0, store
    assert store.get("unavailable", 0) == 0 and not b.cache.tier.store._down(), store
    b.shutdown()
    a.shutdown()


def test_the_master_going_away_fails_closed(k3, master):
    ckpt = k3
    a, p, q = writer(ckpt, master.url)
    off = make(ckpt, False, **SMALL)
    a.cache.tier.store.backoff_s = 3600.0  # once found gone, it stays skipped for the test
    master.stop()
    rng = random.Random(9)
    more = [q] + [[rng.randrange(a.model.config.vocab_size) for _ in range(70)] for _ in range(2)]
    for x in more:
        assert answer(a, x) == answer(off, x)
    deadline = time.monotonic() + 120  # the client's RPCs to a gone master time out in seconds
    while tiers(a)["store"].get("unavailable", 0) == 0:
        assert time.monotonic() < deadline, tiers(a)
        time.sleep(0.2)
    for x in more:
        assert a.reset_prefix_cache()
        assert answer(a, x) == answer(off, x)
    store = tiers(a)["store"]
    assert store["hits"] == 0 and store["probes_skipped"] > 0 and store["writes_dropped"] > 0, store
    assert_all_free(a)
    a.shutdown()


def test_no_master_is_a_clear_startup_error(k3):
    master_binary()
    with pytest.raises(StoreUnavailable, match="no Mooncake master answers"):
        make(k3, True, **SMALL, kv_store=f"mooncake://127.0.0.1:{free_port()}")
