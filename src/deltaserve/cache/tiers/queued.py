"""`QueuedTier`: what the disk and the shared tier have in common, a tier whose writes and reads
run on its own two threads, never on the engine thread.

Writes: `submit` queues an object (never blocks); the writer thread hands each to the subclass's
`_write`. While an object is queued it is `pending` (its manifest, answered by `meta(pending=True)`)
and its bytes count in `pending_bytes`; past `max_pending` bytes queued, new objects are dropped
(counted `writes_dropped`), and so is whatever the subclass `_refuses`. A failed write is
counted (`write_errors`, or the subclass's `_write_failed`) and never ends the thread.

Reads: `prefetch` hands the key of an object the index holds to the reader thread, which
`read`s (and verifies) it into `staged`, where the engine thread `take`s it; meanwhile the engine
steps. `reading` maps each key being read to when its read was queued. Staged objects whose
reader left are dropped oldest first past `max_pending` bytes. A subclass may queue other jobs
on the reader (`_job`).

Invariants (under `lock`, which guards every field the threads share): `pending_bytes` is the
sum of the queued objects' bytes and `staged_bytes` of the staged ones'; a key is in `reading`
from its `prefetch` until its read ended (staged or missed). `index` holds the manifests the
tier answers for (least recently used first); subclasses define what puts them there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict

from .objects import Meta, TierObject

log = logging.getLogger(__name__)


class QueuedTier:
    name = ""

    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self.index: OrderedDict[bytes, Meta] = OrderedDict()
        self.pending: dict[bytes, Meta] = {}
        self.pending_bytes = 0
        self.staged: OrderedDict[bytes, TierObject] = OrderedDict()
        self.staged_bytes = 0
        self.reading: dict[bytes, float] = {}
        self.counters: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._writes: queue.Queue[TierObject | None] = queue.Queue()
        self._reads: queue.Queue[tuple | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name=f"deltaserve-{self.name}-writes", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"deltaserve-{self.name}-reads", daemon=True)

    def _start(self) -> None:
        self._writer.start()
        self._reader.start()

    # subclass hooks
    def _write(self, obj: TierObject) -> None:
        raise NotImplementedError

    def read(self, key: bytes) -> TierObject | None:
        raise NotImplementedError

    def _refuses(self, size: int) -> bool:
        """Whether an object of `size` bytes is dropped at `submit` (caller holds `lock`)."""
        return False

    def _write_failed(self, e: Exception) -> None:
        log.warning("%s tier: writing an object failed: %s", self.name, e)
        with self.lock:
            self.counters["write_errors"] += 1

    def _job(self, kind: str, arg) -> None:
        """Run a reader job other than "read" (none here)."""
        raise ValueError(f"no reader job {kind!r}")

    def _job_done(self, kind: str, arg) -> None:
        """A job other than "read" ended (caller holds `lock`)."""

    # engine thread
    def touch(self, key: bytes) -> None:
        with self.lock:
            if key in self.index:
                self.index.move_to_end(key)

    def submit(self, obj: TierObject) -> None:
        """Queue `obj` for writing (never blocks); dropped (counted `writes_dropped`) when the
        subclass refuses it or past `max_pending` bytes queued."""
        key, size = obj.meta.key, obj.meta.nbytes
        with self.lock:
            if key in self.index or key in self.pending:
                return
            if self._refuses(size) or (self.pending and self.pending_bytes + size > self.max_pending):
                self.counters["writes_dropped"] += 1
                return
            self.pending[key] = obj.meta
            self.pending_bytes += size
        self._writes.put(obj)

    def prefetch(self, key: bytes) -> None:
        """Read and verify the indexed object at `key` on the reader thread, into `staged`."""
        with self.lock:
            if key in self.reading or key in self.staged or key not in self.index:
                return
            self.reading[key] = time.monotonic()
        self._reads.put(("read", key))

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

    def flush(self) -> None:
        """Wait until every queued object is written (or failed, or dropped)."""
        self._writes.join()

    # the threads
    def _write_loop(self) -> None:
        while (obj := self._writes.get()) is not None:
            try:
                self._write(obj)
            except Exception as e:  # a failed write must not end the writer
                self._write_failed(e)
            finally:
                with self.lock:
                    self.pending.pop(obj.meta.key, None)
                    self.pending_bytes -= obj.meta.nbytes
                self._writes.task_done()
        self._writes.task_done()

    def _stage(self, obj: TierObject) -> None:
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
                    if (obj := self.read(arg)) is not None:
                        self._stage(obj)
                else:
                    self._job(kind, arg)
            except Exception as e:  # a failed read must not end the reader
                log.warning("%s tier: a read failed: %s", self.name, e)
                with self.lock:
                    self.counters["read_errors"] += 1
            finally:
                with self.lock:
                    if kind == "read":
                        self.reading.pop(arg, None)
                    else:
                        self._job_done(kind, arg)

    def _stop(self, timeout: float | None = None) -> bool:
        """Write what is queued and end both threads; False if one is still running after
        `timeout` seconds (per thread)."""
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(timeout)
        self._reader.join(timeout)
        return not (self._writer.is_alive() or self._reader.is_alive())

    def _usage(self) -> tuple[int, int]:
        """(bytes used, bytes limit) for `stats` (caller holds `lock`)."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        with self.lock:
            used, limit = self._usage()
            return dict(self.counters) | {
                "objects": len(self.index),
                "bytes_used": used,
                "bytes_limit": limit,
                "bytes_pending": self.pending_bytes,
            }
