"""The shared tier (`--kv-store`): tier objects in a distributed store that every instance of the
same model reads, so one replica resumes a prefix another one computed.

Store keys: `deltaserve/deltaserve-tier-object-v1/<fingerprint hex>/<chain hash hex>`, the value
is the object's file exactly as the disk tier writes it (`objects.encode`: safetensors bytes with
the manifest). Engines of other models or layouts use other keys; the fingerprint inside the
object is checked all the same.

No call into the store runs on the engine thread (a store whose master is gone answers after
seconds): a writer thread `put`s what `submit` queued (past `max_pending` bytes queued, new objects
are dropped, counted), a reader thread runs `prefetch` reads and `probe`s. A probe asks the store
which boundaries of a request's chain it holds (one RPC), then reads the deepest object and its
parents down to what the device or the local tiers hold, verifies each (complete, our fingerprint,
the manifest the chain expects, the digest) and stages them; the lookup that queued it holds the
request (`probe` answers True) for at most `wait_s`, then goes on without. A failed check is a
counted miss (`verify_miss_<reason>`) and the object is removed from the store; a failed RPC marks
the store unavailable for `backoff_s` (counted `unavailable`): writes are dropped and lookups skip
it meanwhile. So a store that goes away costs misses, never a wrong restore or a stuck step.

`known` lists the objects this engine wrote or verified (their manifests): what `meta` answers
without a probe. It is a local belief: the store evicts on its own, and a read of an object that
is gone is a counted miss. `lock` guards every field the threads share.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict

from .mooncake import StoreDown
from .objects import FORMAT, Meta, ObjectError, TierObject, decode, encode, read_header

log = logging.getLogger(__name__)
KNOWN_MAX = 1 << 16  # manifests remembered
PROBED_MAX = 4096  # chains whose probe finished, remembered for `reprobe_s`


class SharedTier:
    name = "store"

    def __init__(self, client, fingerprint: bytes, lent: int = 0, max_pending: int | None = None):
        self.client, self.fingerprint, self.lent = client, fingerprint, lent
        self.prefix = f"deltaserve/{FORMAT}/{fingerprint.hex()}/"
        self.wait_s, self.reprobe_s, self.backoff_s = 2.0, 1.0, 5.0
        self.known: OrderedDict[bytes, Meta] = OrderedDict()
        self.pending: dict[bytes, Meta] = {}
        self.pending_bytes, self.max_pending = 0, max_pending or (1 << 30)
        self.staged: OrderedDict[bytes, TierObject] = OrderedDict()
        self.staged_bytes = 0
        self.reading: dict[bytes, float] = {}  # key -> when its read was queued
        self.probing: dict[bytes, float] = {}  # chain target -> when its probe was queued
        self.probed: OrderedDict[bytes, float] = OrderedDict()  # chain target -> when its probe ended
        self.down_until = 0.0
        self.counters: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._writes: queue.Queue[TierObject | None] = queue.Queue()
        self._reads: queue.Queue[tuple | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="deltaserve-store-writes", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="deltaserve-store-reads", daemon=True)
        self._writer.start()
        self._reader.start()
        self.closed = False

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
        """The known object at `key` (with `pending`, also one queued for writing); None while
        the store is unavailable or its read has been in flight for `wait_s` (go on without)."""
        with self.lock:
            t = self.reading.get(key)
            if self._down() or (t is not None and time.monotonic() - t >= self.wait_s):
                return None
            m = self.known.get(key)
            return m if m is not None or not pending else self.pending.get(key)

    def touch(self, key: bytes) -> None:
        with self.lock:
            if key in self.known:
                self.known.move_to_end(key)

    def _know(self, meta: Meta) -> None:
        """Remember a manifest (caller holds `lock`)."""
        self.known[meta.key] = meta
        self.known.move_to_end(meta.key)
        while len(self.known) > KNOWN_MAX:
            self.known.popitem(last=False)

    # writes
    def submit(self, obj: TierObject) -> None:
        """Queue `obj` for the store (never blocks); dropped while the store is unavailable or
        past `max_pending` bytes queued (counted `writes_dropped`)."""
        key, size = obj.meta.key, obj.meta.nbytes
        with self.lock:
            if key in self.known or key in self.pending:
                return
            if self._down() or (self.pending and self.pending_bytes + size > self.max_pending):
                self.counters["writes_dropped"] += 1
                return
            self.pending[key] = obj.meta
            self.pending_bytes += size
        self._writes.put(obj)

    def _write_loop(self) -> None:
        while (obj := self._writes.get()) is not None:
            try:
                if self._down():
                    with self.lock:
                        self.counters["writes_dropped"] += 1
                else:
                    self._write(obj)
            except StoreDown as e:
                self._mark_down(e)
            except Exception as e:  # a client error must not end the writer
                log.warning("shared tier: writing an object failed: %s", e)
                with self.lock:
                    self.counters["write_errors"] += 1
            finally:
                with self.lock:
                    self.pending.pop(obj.meta.key, None)
                    self.pending_bytes -= obj.meta.nbytes
                self._writes.task_done()
        self._writes.task_done()

    def _write(self, obj: TierObject) -> None:
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
        """A counted miss; an object that fails a check leaves the store (best effort)."""
        with self.lock:
            self.counters[f"verify_miss_{e.reason}"] += 1
            self.known.pop(key, None)
        log.warning("shared tier: object %s is not restored (%s)", key.hex()[:16], e)
        if e.reason != "missing":
            try:
                self.client.remove(self.key(key))
            except Exception:  # removing is a courtesy to the other readers
                pass

    def _get(self, key: bytes, want: Meta | None, hashes: list[bytes] | None = None, end: int = 0):
        """The verified object at `key` (manifest `want`, or, for a probe, the one unit `end` of
        `hashes` expects) or None (a counted miss). Raises StoreDown."""
        data = self.client.get(self.key(key))
        try:
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
        """The verified object at `key` (known), or None: a counted miss, or the store is down."""
        want = self.meta(key)
        if want is None or self._down():
            return None
        try:
            return self._get(key, want)
        except StoreDown as e:
            self._mark_down(e)
            return None

    def prefetch(self, key: bytes) -> None:
        """Read and verify the known object at `key` on the reader thread, into `staged`."""
        with self.lock:
            if key in self.reading or key in self.staged or key not in self.known:
                return
            self.reading[key] = time.monotonic()
        self._reads.put(("read", key))

    def take(self, key: bytes) -> TierObject | None:
        with self.lock:
            obj = self.staged.pop(key, None)
            if obj is not None:
                self.staged_bytes -= obj.meta.nbytes
            return obj

    def _stage(self, obj: TierObject) -> None:
        """Objects whose reader left are dropped oldest first past `max_pending` bytes."""
        with self.lock:
            if obj.meta.key not in self.staged:
                self.staged[obj.meta.key] = obj
                self.staged_bytes += obj.meta.nbytes
            while self.staged_bytes > self.max_pending and len(self.staged) > 1:
                self.staged_bytes -= self.staged.popitem(last=False)[1].meta.nbytes

    def _read_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            kind, arg = job
            try:
                if kind == "read":
                    obj = self.read(arg)
                    if obj is not None:
                        self._stage(obj)
                else:
                    self._probe(*arg)
            except Exception as e:  # a client error must not end the reader
                log.warning("shared tier: a read failed: %s", e)
                with self.lock:
                    self.counters["read_errors"] += 1
            finally:
                with self.lock:
                    if kind == "read":
                        self.reading.pop(arg, None)
                    else:
                        self.probing.pop(arg[0][-1], None)
                        self.probed[arg[0][-1]] = time.monotonic()
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

    def flush(self) -> None:
        """Wait until every queued object is written (or dropped)."""
        self._writes.join()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (unless the store is unavailable), stop the threads and leave the
        store (idempotent; bounded by `timeout` per thread when the store hangs)."""
        if self.closed:
            return
        self.closed = True
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout)
        self._reader.join(timeout)
        if self._writer.is_alive() or self._reader.is_alive():
            log.warning("shared tier: the store did not answer in %.0f s; left without closing the client", timeout)
            return
        self.client.close()

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counters) | {
                "objects": len(self.known),
                "bytes_used": sum(m.nbytes for m in self.known.values()),
                "bytes_limit": self.lent,
                "bytes_pending": self.pending_bytes,
            }
