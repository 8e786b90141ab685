"""The local-disk tier (`--kv-disk-path DIR --kv-disk-size SIZE`): one file per tier object,
written by a background thread, indexed in memory, rebuilt from the files' manifests on start.

Layout: `DIR/<first 16 hex digits of the fingerprint>/<key hex>.safetensors`, so engines of other
models or layouts never see each other's objects; the directory is held with an exclusive `flock`
(released by the kernel when the process dies, even by SIGKILL), so one engine owns it.

Writes are atomic: the object goes to a temporary file in the same directory, is fsynced, renamed
over its final name and the directory fsynced; a crash leaves either the whole file or a
temporary one, which the next start deletes. The step never waits for the disk: `submit` queues
a host copy; past `max_pending` bytes queued, new objects are dropped (counted).

Fail-closed: on start every file's header is checked (complete, ours: format, name, fingerprint;
its sizes equal the file's); on every read the bytes are checked against the manifest's digest
and the manifest against what the index expects. A file failing any check is a counted miss
(`verify_misses` by reason), removed from the index and deleted, never restored.

Reads are asynchronous too: `prefetch` hands a key to the reader thread, which reads and
verifies it into `staged`, where the engine thread `take`s it; meanwhile the engine steps.

Threads: the engine thread calls `meta`, `touch`, `read`, `submit`, `prefetch`, `take`; the
writer thread adds written files and evicts over the size limit (least recently used first); the
reader thread reads. `lock` guards the index, the staging area and the counters.
`on_change(key, stored)`, when set, is told each object indexed or dropped, under `lock` (routing
events; the objects found at start are not told).
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
from collections import Counter, OrderedDict
from pathlib import Path

from .objects import Meta, ObjectError, TierObject, decode, encode, read_header

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
HEAD_BYTES = 1 << 16  # a tier object's header (three tensors and the manifest) is far smaller


class DiskInUse(RuntimeError):
    """Another live engine holds the directory."""


class DiskTier:
    name = "disk"

    def __init__(self, root: str | Path, limit: int, fingerprint: bytes, max_pending: int | None = None):
        if limit < 1:
            raise ValueError("the disk tier needs a positive --kv-disk-size")
        self.fingerprint, self.limit, self.used = fingerprint, limit, 0
        self.dir = Path(root) / fingerprint.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lockfile = open(self.dir / ".lock", "a+")
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockfile.close()
            raise DiskInUse(f"--kv-disk-path {root}: {self.dir} is used by another running engine") from None
        self.index: OrderedDict[bytes, Meta] = OrderedDict()
        self.pending: dict[bytes, Meta] = {}
        self.pending_bytes, self.max_pending = 0, max_pending or min(limit, 4 << 30)
        self.counters: Counter[str] = Counter()
        self.on_change = None
        self.lock = threading.Lock()
        self._queue: queue.Queue[TierObject | None] = queue.Queue()
        self.reading: set[bytes] = set()
        self.staged: OrderedDict[bytes, TierObject] = OrderedDict()
        self.staged_bytes = 0
        self._reads: queue.Queue[bytes | None] = queue.Queue()
        self._scan()
        self._thread = threading.Thread(target=self._writer, name="deltaserve-disk-tier", daemon=True)
        self._thread.start()
        self._reader = threading.Thread(target=self._read_ahead, name="deltaserve-disk-reads", daemon=True)
        self._reader.start()

    def path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _scan(self) -> None:
        """Rebuild the index from the files' headers, oldest first (their mtime is their LRU time),
        each object's ancestors after it (so eviction takes children before their parents)."""
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        found = []
        for p in self.dir.glob("*" + SUFFIX):
            try:
                st = p.stat()
                with open(p, "rb") as f:
                    meta, fp, _ = read_header(f.read(HEAD_BYTES), st.st_size)
                if fp != self.fingerprint.hex():
                    raise ObjectError("fingerprint", "written by another model or layout")
                if p.name != meta.key.hex() + SUFFIX:
                    raise ObjectError("manifest", "the manifest names another prefix")
            except ObjectError as e:
                self._reject(p, e)
                continue
            meta.nbytes = st.st_size
            found.append((st.st_mtime_ns, meta))
        for _, meta in sorted(found, key=lambda x: x[0]):
            self.index[meta.key] = meta
            self.used += meta.nbytes
        for key in list(self.index):  # parents after their children, as the store keeps them
            while (m := self.index.get(key)) is not None and m.parent in self.index:
                self.index.move_to_end(m.parent)
                key = m.parent
        self.counters["objects_found"] = len(self.index)
        self._evict()
        log.info("disk tier %s: %d objects, %d bytes of %d", self.dir, len(self.index), self.used, self.limit)

    def _reject(self, path: Path, e: ObjectError) -> None:
        self.counters[f"verify_miss_{e.reason}"] += 1
        log.warning("disk tier: %s is not restored (%s); deleted", path.name, e)
        path.unlink(missing_ok=True)

    def meta(self, key: bytes, pending: bool = False) -> Meta | None:
        """The indexed object at `key`; with `pending`, also one queued for writing."""
        with self.lock:
            m = self.index.get(key)
            return m if m is not None or not pending else self.pending.get(key)

    def touch(self, key: bytes) -> None:
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)

    def submit(self, obj: TierObject) -> None:
        """Queue `obj` for writing (never blocks); dropped if too large or too much is queued."""
        key, size = obj.meta.key, obj.meta.nbytes
        with self.lock:
            if key in self.index or key in self.pending:
                return
            if size > self.limit or (self.pending and self.pending_bytes + size > self.max_pending):
                self.counters["writes_dropped"] += 1
                return
            self.pending[key] = obj.meta
            self.pending_bytes += size
        self._queue.put(obj)

    def _writer(self) -> None:
        while (obj := self._queue.get()) is not None:
            try:
                self._write(obj)
            except OSError as e:
                log.warning("disk tier: writing an object failed: %s", e)
                with self.lock:
                    self.counters["write_errors"] += 1
            finally:
                with self.lock:
                    self.pending.pop(obj.meta.key, None)
                    self.pending_bytes -= obj.meta.nbytes
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, obj: TierObject) -> None:
        data = encode(obj, self.fingerprint)
        final = self.path(obj.meta.key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        meta = Meta(obj.meta.key, obj.meta.parent, obj.meta.start, obj.meta.end, len(data))
        with self.lock:
            self.index[meta.key] = meta
            self.used += meta.nbytes
            self.counters["objects_written"] += 1
            self.counters["bytes_written"] += meta.nbytes
            self._told(meta.key, True)
            self._evict()

    def _evict(self) -> None:
        """Delete least recently used files until `used <= limit` (caller holds `lock` or is alone)."""
        while self.used > self.limit and self.index:
            key, meta = self.index.popitem(last=False)
            self.used -= meta.nbytes
            self.counters["evicted"] += 1
            self._told(key, False)
            self.path(key).unlink(missing_ok=True)

    def _told(self, key: bytes, stored: bool) -> None:
        if self.on_change is not None:
            self.on_change(key, stored)

    def read(self, key: bytes) -> TierObject | None:
        """The verified object at `key`, or None (a counted miss: the file is gone, cut, foreign or
        corrupt; it leaves the index)."""
        want = self.meta(key)
        if want is None:
            return None
        path = self.path(key)
        try:
            try:
                data = path.read_bytes()
            except OSError as e:
                raise ObjectError("missing" if isinstance(e, FileNotFoundError) else "io", str(e)) from None
            obj = decode(data, self.fingerprint, want)
        except ObjectError as e:
            with self.lock:
                if self.index.pop(key, None) is not None:
                    self.used -= want.nbytes
                    self._told(key, False)
                self._reject(path, e)
            return None
        with self.lock:
            self.counters["bytes_read"] += len(data)
            if key in self.index:
                self.index.move_to_end(key)
        try:
            os.utime(path)  # its mtime is its LRU time across restarts
        except FileNotFoundError:
            pass
        return obj

    def prefetch(self, key: bytes) -> None:
        """Read and verify the object at `key` on the reader thread, into `staged` (`take`)."""
        with self.lock:
            if key in self.reading or key in self.staged or key not in self.index:
                return
            self.reading.add(key)
        self._reads.put(key)

    def in_flight(self, key: bytes) -> bool:
        with self.lock:
            return key in self.reading

    def take(self, key: bytes) -> TierObject | None:
        """The staged (read and verified) object at `key`, or None."""
        with self.lock:
            obj = self.staged.pop(key, None)
            if obj is not None:
                self.staged_bytes -= obj.meta.nbytes
            return obj

    def _read_ahead(self) -> None:
        """Staged objects are dropped oldest first past `max_pending` bytes (their reader left)."""
        while (key := self._reads.get()) is not None:
            obj = self.read(key)
            with self.lock:
                self.reading.discard(key)
                if obj is not None:
                    self.staged[key] = obj
                    self.staged_bytes += obj.meta.nbytes
                while self.staged_bytes > self.max_pending and len(self.staged) > 1:
                    self.staged_bytes -= self.staged.popitem(last=False)[1].meta.nbytes

    def flush(self) -> None:
        """Wait until every queued object is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the writer and release the directory (idempotent)."""
        if self._lockfile.closed:
            return
        self._queue.put(None)
        self._reads.put(None)
        self._thread.join()
        self._reader.join()
        fcntl.flock(self._lockfile, fcntl.LOCK_UN)
        self._lockfile.close()

    def stats(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counters) | {
                "objects": len(self.index),
                "bytes_used": self.used,
                "bytes_limit": self.limit,
                "bytes_pending": self.pending_bytes,
            }
