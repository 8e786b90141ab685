"""The shared tier on its own, over an in-memory stand-in for the store client: a probe finds the
deepest object of a chain and reads its parents, verified, off the caller's thread; a broken
chain stages nothing; a store that fails an RPC is skipped (lookups, writes) instead of waited on."""

import hashlib
import time

import torch

from deltaserve.cache.tiers.mooncake import StoreDown
from deltaserve.cache.tiers.objects import Meta, TierObject, encode
from deltaserve.cache.tiers.shared import SharedTier

FP = hashlib.sha256(b"model").digest()
CHAIN = [hashlib.sha256(bytes([i])).digest() for i in range(6)]


class FakeClient:
    def __init__(self, down: bool = False):
        self.values: dict[str, bytes] = {}
        self.down, self.calls = down, 0

    def _rpc(self) -> None:
        self.calls += 1
        if self.down:
            raise StoreDown("master gone")

    def put(self, key: str, data: bytes) -> int:
        self._rpc()
        self.values.setdefault(key, data)
        return 0

    def get(self, key: str) -> bytes | None:
        self._rpc()
        return self.values.get(key)

    def exists(self, keys: list[str]) -> list[int]:
        self._rpc()
        return [int(k in self.values) for k in keys]

    def remove(self, key: str) -> int:
        self.values.pop(key, None)
        return 0

    def close(self) -> None:
        pass


def obj(start: int, end: int) -> TierObject:
    g = torch.Generator().manual_seed(end)
    t = [torch.randn(2, end - start, 5, generator=g), torch.randn(3, 6, generator=g), torch.randn(3, 4, generator=g)]
    parent = CHAIN[start - 1] if start else b""
    return TierObject(Meta(CHAIN[end - 1], parent, start, end, sum(x.nbytes for x in t)), *t)


def settle(tier: SharedTier) -> None:
    deadline = time.monotonic() + 30
    while tier.probing or tier.reading:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_probe_stages_the_deepest_object_and_its_parents():
    client = FakeClient()
    writer = SharedTier(client, FP)
    for o in (obj(0, 2), obj(2, 5)):
        writer.submit(o)
    writer.flush()
    assert writer.stats()["objects_written"] == 2
    reader = SharedTier(client, FP)
    assert reader.meta(CHAIN[4]) is None, "another engine's objects are unknown before a probe"
    assert reader.probe(CHAIN, 0, 0, set()) is True
    settle(reader)
    assert set(reader.staged) == {CHAIN[1], CHAIN[4]} and reader.meta(CHAIN[4]).start == 2
    assert torch.equal(reader.take(CHAIN[4]).mla, obj(2, 5).mla)
    assert reader.probe(CHAIN, 0, 0, set()) is False, "asked within reprobe_s"
    other = SharedTier(client, FP)  # its device holds units [0, 2): only the top object is read
    assert other.probe(CHAIN, 0, 2, set()) is True
    settle(other)
    assert set(other.staged) == {CHAIN[4]}
    for t in (writer, reader, other):
        t.close()


def test_a_chain_with_a_missing_parent_stages_nothing():
    client = FakeClient()
    client.values[SharedTier(client, FP).key(CHAIN[4])] = encode(obj(2, 5), FP)
    tier = SharedTier(client, FP)
    assert tier.probe(CHAIN, 0, 0, set()) is True
    settle(tier)
    assert not tier.staged
    local = SharedTier(client, FP)  # a local tier holds the parent: the top object suffices
    assert local.probe(CHAIN, 0, 0, {CHAIN[1]}) is True
    settle(local)
    assert set(local.staged) == {CHAIN[4]}


def test_an_unavailable_store_is_skipped_not_waited_on():
    client = FakeClient(down=True)
    tier = SharedTier(client, FP)
    tier.backoff_s = 3600.0
    assert tier.probe(CHAIN, 0, 0, set()) is True
    settle(tier)
    calls = client.calls
    assert tier.stats()["unavailable"] == 1
    assert tier.probe(CHAIN[:5], 0, 0, set()) is False and tier.stats()["probes_skipped"] == 1
    tier.submit(obj(0, 2))
    assert tier.stats()["writes_dropped"] == 1 and client.calls == calls
    tier.close()
