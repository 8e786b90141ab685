"""The host-memory tier (`--kv-offload-memory`): tier objects kept as host tensors, LRU by bytes.

Used on the engine thread only. Invariant: `used` is the sum of the held objects' bytes and
never exceeds `limit` after a call returns; an object larger than `limit` is not kept.
`on_change(key, stored)`, when set, is told each object kept or evicted (routing events).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from .objects import Meta, TierObject


class HostTier:
    name = "host"

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("the host tier needs a positive size")
        self.limit, self.used = limit, 0
        self.objects: OrderedDict[bytes, TierObject] = OrderedDict()
        self.counters: Counter[str] = Counter()
        self.on_change = None

    def meta(self, key: bytes) -> Meta | None:
        obj = self.objects.get(key)
        return obj.meta if obj is not None else None

    def touch(self, key: bytes) -> None:
        if key in self.objects:
            self.objects.move_to_end(key)

    def put(self, obj: TierObject) -> None:
        """Keep `obj` (most recently used), evicting least recently used objects over the limit."""
        key, size = obj.meta.key, obj.meta.nbytes
        if key in self.objects or size > self.limit:
            self.touch(key)
            return
        self.objects[key] = obj
        self.used += size
        self.counters["objects_written"] += 1
        self.counters["bytes_written"] += size
        if self.on_change is not None:
            self.on_change(key, True)
        while self.used > self.limit:
            old_key, old = self.objects.popitem(last=False)
            self.used -= old.meta.nbytes
            self.counters["evicted"] += 1
            if self.on_change is not None:
                self.on_change(old_key, False)

    def get(self, key: bytes) -> TierObject | None:
        obj = self.objects.get(key)
        if obj is not None:
            self.objects.move_to_end(key)
            self.counters["bytes_read"] += obj.meta.nbytes
        return obj

    def stats(self) -> dict[str, int]:
        return dict(self.counters) | {"objects": len(self.objects), "bytes_used": self.used, "bytes_limit": self.limit}
