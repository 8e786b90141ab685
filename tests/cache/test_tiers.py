"""The tier objects and the host / disk tiers on their own: exact round trips, LRU by bytes,
atomic writes, the index rebuilt on start (oldest first), one engine per directory."""

import hashlib

import pytest
import torch

from deltaserve.cache.tiers.disk import DiskInUse, DiskTier
from deltaserve.cache.tiers.host import HostTier
from deltaserve.cache.tiers.objects import Meta, ObjectError, TierObject, decode, encode

FP = hashlib.sha256(b"model").digest()


def obj(i: int, start: int = 0) -> TierObject:
    g = torch.Generator().manual_seed(i)
    key = hashlib.sha256(str(i).encode()).digest()
    parent = hashlib.sha256(str(i - 1).encode()).digest() if start else b""
    t = [torch.randn(2, 8, 5, generator=g), torch.randn(3, 3, 6, generator=g), torch.randn(3, 2, 4, 4, generator=g)]
    o = TierObject(Meta(key, parent, start, start + 1, 0), *t)
    o.meta.nbytes = sum(x.numel() * x.element_size() for x in t)
    return o


def same(a: TierObject, b: TierObject) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))


def test_encode_decode_round_trip_and_checks():
    o = obj(1, start=1)
    data = encode(o, FP)
    assert same(decode(data, FP, o.meta), o)
    with pytest.raises(ObjectError, match="fingerprint"):
        decode(data, bytes(32), o.meta)
    with pytest.raises(ObjectError, match="manifest"):
        decode(data, FP, obj(2).meta)
    with pytest.raises(ObjectError, match="torn"):
        decode(data[:-1], FP, o.meta)
    bad = bytearray(data)
    bad[-3] ^= 1
    with pytest.raises(ObjectError, match="digest"):
        decode(bytes(bad), FP, o.meta)


def test_host_tier_keeps_the_most_recent_within_its_bytes():
    objs = [obj(i) for i in range(4)]
    host = HostTier(3 * objs[0].meta.nbytes)
    for o in objs[:3]:
        host.put(o)
    host.get(objs[0].meta.key)  # 0 is now the most recent: 1 goes first
    host.put(objs[3])
    assert list(host.objects) == [objs[i].meta.key for i in (2, 0, 3)]
    assert host.stats()["evicted"] == 1 and host.used <= host.limit


def test_disk_tier_writes_atomically_and_rebuilds_its_index(tmp_path):
    objs = [obj(i) for i in range(4)]
    size = len(encode(objs[0], FP))
    disk = DiskTier(tmp_path, 3 * size, FP)
    with pytest.raises(DiskInUse):
        DiskTier(tmp_path, 3 * size, FP)
    for o in objs[:3]:
        disk.submit(o)
        disk.flush()
    assert same(disk.read(objs[0].meta.key), objs[0])  # read: most recent
    disk.submit(objs[3])
    disk.close()
    assert not list(disk.dir.glob("*.tmp"))
    assert sorted(p.name for p in disk.dir.glob("*.safetensors")) == sorted(
        objs[i].meta.key.hex() + ".safetensors" for i in (0, 2, 3)
    )
    (disk.dir / "leftover.safetensors.1.tmp").write_bytes(b"half")
    again = DiskTier(tmp_path, 3 * size, FP)
    assert set(again.index) == {objs[i].meta.key for i in (0, 2, 3)} and not list(again.dir.glob("*.tmp"))
    assert same(again.read(objs[2].meta.key), objs[2])
    again.close()
    other = DiskTier(tmp_path, size, bytes(32))  # another model: its own directory, nothing found
    assert not other.index and other.dir != again.dir
    other.close()


def test_disk_tier_drops_what_it_cannot_queue(tmp_path):
    objs = [obj(i) for i in range(3)]
    disk = DiskTier(tmp_path, 1 << 20, FP, max_pending=1)
    disk._writes.put(None)  # stop the writer: everything stays queued
    disk._writer.join()
    disk.submit(objs[0])  # an empty queue always takes one
    disk.submit(objs[1])
    assert disk.stats()["writes_dropped"] == 1 and disk.stats()["bytes_pending"] == objs[0].meta.nbytes
