"""The shared tier (`--kv-store`): tier objects in a distributed store that every instance of the
same model reads, so one replica resumes a prefix another one computed.

Store keys: `deltaserve/deltaserve-tier-object-v1/<fingerprint hex>/<chain hash hex>`, the value
is the object's file exactly as the disk tier writes it (`objects.encode`: safetensors bytes with
the manifest). Engines of other models or layouts use other keys; the fingerprint inside the
object is checked all the same.

No call into the store runs on the engine thread (a store whose master is gone answers after
seconds): the writer thread `put`s what `submit` queued (`queued.QueuedTier`: past `max_pending`
bytes queued, new objects are dropped, counted), the reader thread runs `prefetch` reads and
`probe`s. A probe asks the store which boundaries of a request's chain it holds (one RPC), then
reads the deepest object and its parents down to what the device or the local tiers hold,
verifies each (complete, our fingerprint, the manifest the chain expects, the digest) and stages
them; the lookup that queued it holds the
request (`probe` answers True) for at most `wait_s`, then goes on without. A failed check is a
counted miss (`verify_miss_<reason>`) and the object is removed from the store; an object whose
bytes cannot be read (`unreadable`: the instance lending its segment died) is a counted miss too,
left for the master to drop. A failed RPC marks the store unavailable for `backoff_s` (counted
`unavailable`): writes are dropped and lookups skip it meanwhile. So a store that goes away
costs misses, never a wrong restore or a stuck step.

`index` lists the objects this engine wrote or verified (their manifests): what `meta` answers
without a probe. It is a local belief: the store evicts on its own, and a read of an object that
is gone is a counted miss. `lock` guards every field the threads share.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from .mooncake import StoreDown, Unreadable
from .objects import FORMAT, Meta, ObjectError, TierObject, decode, encode, read_header
from .queued import QueuedTier

log = logging.getLogger(__name__)
KNOWN_MAX = 1 << 16  # manifests remembered
PROBED_MAX = 4096  # chains whose probe finished, remembered for `reprobe_s`


class SharedTier(QueuedTier):
    name = "store"

    def __init__(self, client, fingerprint: bytes, lent: int = 0, max_pending: int | None = None):
        super().__init__(max_pending or (1 << 30))
        self.client, self.fingerprint, self.lent = client, fingerprint, lent
        self.prefix = f"deltaserve/{FORMAT}/{fingerprint.hex()}/"
        self.wait_s, self.reprobe_s, self.backoff_s = 2.0, 1.0, 5.0
        self.probing: dict[bytes, float] = {}  # chain target -> when its probe was queued
        self.probed: OrderedDict[bytes, float] = OrderedDict()  # chain target -> when its probe ended
        self.down_until = 0.0
        self.closed = False
        self._start()

    def key(self, h: bytes) -> str:
        """The store key of the object ending at chain hash `h`."""
        return self.prefix + h.hex()

    def _down(self) -> bool:
        return time.monotonic() < self.down_until

    def _mark_down(self, e: Exception) -> None:
        with self.lock:
            self.counters["unavailable"] += 1
            self.down_until = time.monotonic() + self.backoff_s
        log.warning("shared tier: the store is unavailable (%s); skipped for %.0f s", e, self.backoff_s)

    # engine thread: the index
    def meta(self, key: bytes, pending: bool = False) -> Meta | None:
        """The indexed object at `key` (with `pending`, also one queued for writing); None while
        the store is unavailable or its read has been in flight for `wait_s` (go on without)."""
        with self.lock:
            t = self.reading.get(key)
            if self._down() or (t is not None and time.monotonic() - t >= self.wait_s):
                return None
            m = self.index.get(key)
            return m if m is not None or not pending else self.pending.get(key)

    def _know(self, meta: Meta) -> None:
        """Remember a manifest (caller holds `lock`)."""
        self.index[meta.key] = meta
        self.index.move_to_end(meta.key)
        while len(self.index) > KNOWN_MAX:
            self.index.popitem(last=False)

    # writes
    def _refuses(self, size: int) -> bool:
        return self._down()

    def _write_failed(self, e: Exception) -> None:
        if isinstance(e, StoreDown):
            self._mark_down(e)
        else:
            super()._write_failed(e)

    def _write(self, obj: TierObject) -> None:
        if self._down():
            with self.lock:
                self.counters["writes_dropped"] += 1
            return
        data = encode(obj, self.fingerprint)
        rc = self.client.put(self.key(obj.meta.key), data)
        with self.lock:
            if rc != 0:
                self.counters["write_errors"] += 1
                return
            m = obj.meta
            self._know(Meta(m.key, m.parent, m.start, m.end, len(data)))
            self.counters["objects_written"] += 1
            self.counters["bytes_written"] += len(data)

    # reads
    def _reject(self, key: bytes, e: ObjectError) -> None:
        """A counted miss; an object that fails a check leaves the store (best effort; one
        missing or unreadable stays: it is gone, or its reading failed)."""
        with self.lock:
            self.counters[f"verify_miss_{e.reason}"] += 1
            self.index.pop(key, None)
        log.warning("shared tier: object %s is not restored (%s)", key.hex()[:16], e)
        if e.reason not in ("missing", "unreadable"):
            try:
                self.client.remove(self.key(key))
            except Exception:  # removing is a courtesy to the other readers
                pass

    def _get(self, key: bytes, want: Meta | None, hashes: list[bytes] | None = None, end: int = 0):
        """The verified object at `key` (manifest `want`, or, for a probe, the one unit `end` of
        `hashes` expects) or None (a counted miss). Raises StoreDown."""
        try:
            try:
                data = self.client.get(self.key(key))
            except Unreadable as e:
                raise ObjectError("unreadable", str(e)) from None
            if data is None:
                raise ObjectError("missing", "not in the store")
            if want is None:
                m, _, _ = read_header(data, len(data))
                if not 0 <= m.start < end:
                    raise ObjectError("manifest", "the manifest names another prefix")
                want = Meta(key, hashes[m.start - 1] if m.start else b"", m.start, end, 0)
            obj = decode(data, self.fingerprint, want)
        except ObjectError as e:
            self._reject(key, e)
            return None
        obj.meta.nbytes = len(data)
        with self.lock:
            self.counters["bytes_read"] += len(data)
            self._know(obj.meta)
        return obj

    def read(self, key: bytes) -> TierObject | None:
        """The verified object at `key` (indexed), or None: a counted miss, or the store is down."""
        want = self.meta(key)
        if want is None or self._down():
            return None
        try:
            return self._get(key, want)
        except StoreDown as e:
            self._mark_down(e)
            return None

    def _job(self, kind: str, arg) -> None:
        self._probe(*arg)

    def _job_done(self, kind: str, arg) -> None:
        target = arg[0][-1]
        self.probing.pop(target, None)
        self.probed[target] = time.monotonic()
        while len(self.probed) > PROBED_MAX:
            self.probed.popitem(last=False)

    # probes
    def probe(self, hashes: list[bytes], lo: int, k_mla: int, local: set[bytes]) -> bool:
        """Look for objects ending past unit `lo` of `hashes` in the store (`local`: the chain's
        keys the device or the other tiers hold). True: a probe of this chain is in flight and
        younger than `wait_s` (the caller holds the request and asks again); False: go on
        without (nothing to ask, asked within `reprobe_s`, the store unavailable or busy)."""
        if lo >= len(hashes):
            return False
        target, now = hashes[-1], time.monotonic()
        with self.lock:
            if target in self.probing:
                return now - self.probing[target] < self.wait_s
            if now < self.down_until or any(now - t >= self.wait_s for t in self.probing.values()):
                self.counters["probes_skipped"] += 1
                return False
            if (t := self.probed.get(target)) is not None and now - t < self.reprobe_s:
                return False
            self.probing[target] = now
            self.counters["probes"] += 1
        self._reads.put(("probe", (list(hashes), lo, k_mla, frozenset(local))))
        return True

    def _probe(self, hashes: list[bytes], lo: int, k_mla: int, local: frozenset[bytes]) -> None:
        if self._down():
            return
        ks = range(lo + 1, len(hashes) + 1)
        try:
            codes = self.client.exists([self.key(hashes[k - 1]) for k in ks])
            have = {k for k, c in zip(ks, codes) if c == 1}
            for k in sorted(have, reverse=True):
                if self._read_chain(hashes, k, k_mla, have, local):
                    return
        except StoreDown as e:
            self._mark_down(e)

    def _read_chain(self, hashes, k: int, k_mla: int, have: set[int], local: frozenset[bytes]) -> bool:
        """Read and verify the object ending at unit `k` and its parents until the device (its
        MLA units up to `k_mla`), a local tier or a known object holds the rest; stage them."""

        def held(key: bytes) -> bool:
            return key in local or self.meta(key) is not None

        if held(hashes[k - 1]):
            return True
        objs, end = [], k
        while True:
            obj = self._get(hashes[end - 1], None, hashes, end)
            if obj is None:
                return False
            objs.append(obj)
            start = obj.meta.start
            if start <= k_mla or held(hashes[start - 1]):
                break
            if start not in have:
                return False
            end = start
        for obj in objs:
            self._stage(obj)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (unless the store is unavailable), stop the threads and leave the
        store (idempotent; bounded by `timeout` per thread when the store hangs)."""
        if self.closed:
            return
        self.closed = True
        if not self._stop(timeout):
            log.warning("shared tier: the store did not answer in %.0f s; left without closing the client", timeout)
            return
        self.client.close()

    def _usage(self) -> tuple[int, int]:
        return sum(m.nbytes for m in self.index.values()), self.lent
