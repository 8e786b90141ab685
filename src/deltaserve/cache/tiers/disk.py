"""The local-disk tier (`--kv-disk-path DIR --kv-disk-size SIZE`): one file per tier object,
written by a background thread, indexed in memory, rebuilt from the files' manifests on start.

Layout: `DIR/<first 16 hex digits of the fingerprint>/<key hex>.safetensors`, so engines of other
models or layouts never see each other's objects; the directory is held with an exclusive `flock`
(released by the kernel when the process dies, even by SIGKILL), so one engine owns it.

Writes are atomic: the object goes to a temporary file in the same directory, is fsynced, renamed
over its final name and the directory fsynced; a crash leaves either the whole file or a
temporary one, which the next start deletes. The step never waits for the disk: `submit` queues
a host copy (`queued.QueuedTier`: past `max_pending` bytes queued, or larger than the limit, new
objects are dropped, counted).

Fail-closed: on start every file's header is checked (complete, ours: format, name, fingerprint;
its sizes equal the file's); on every read the bytes are checked against the manifest's digest
and the manifest against what the index expects. A file failing any check is a counted miss
(`verify_misses` by reason), removed from the index and deleted, never restored.

Reads are asynchronous too (`QueuedTier.prefetch`): the reader thread `read`s and verifies an
object into `staged`, where the engine thread `take`s it; meanwhile the engine steps.

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
from pathlib import Path

from .objects import Meta, ObjectError, TierObject, decode, encode, read_header
from .queued import QueuedTier

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
HEAD_BYTES = 1 << 16  # a tier object's header (three tensors and the manifest) is far smaller


class DiskInUse(RuntimeError):
    """Another live engine holds the directory."""


def replica_disk_path(root: str | Path, replica: int) -> str:
    """Data-parallel replica `replica`'s own `--kv-disk-path` under the one given (the same
    across its restarts, so a restarted replica finds its objects)."""
    return str(Path(root) / f"replica-{replica}")


class DiskTier(QueuedTier):
    name = "disk"

    def __init__(self, root: str | Path, limit: int, fingerprint: bytes, max_pending: int | None = None):
        if limit < 1:
            raise ValueError("the disk tier needs a positive --kv-disk-size")
        super().__init__(max_pending or min(limit, 4 << 30))
        self.fingerprint, self.limit, self.used = fingerprint, limit, 0
        self.dir = Path(root) / fingerprint.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lockfile = open(self.dir / ".lock", "a+")
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockfile.close()
            raise DiskInUse(f"--kv-disk-path {root}: {self.dir} is used by another running engine") from None
        self.on_change = None
        self._scan()
        self._start()

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

    def _refuses(self, size: int) -> bool:
        return size > self.limit

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

    def close(self) -> None:
        """Write what is queued, stop the writer and release the directory (idempotent)."""
        if self._lockfile.closed:
            return
        self._stop()
        fcntl.flock(self._lockfile, fcntl.LOCK_UN)
        self._lockfile.close()

    def _usage(self) -> tuple[int, int]:
        return self.used, self.limit
