"""The replica processes of `serve --data-parallel-size N` (`replica_front.py` routes to them):
started with a deadline, watched, and restarted with backoff when they die.

Each replica is a `deltaserve serve` subprocess on a free loopback port. Its states:
- **starting**: spawned, not yet answering `/health`; past its deadline it is killed and counted
  as a failed start;
- **live**: answering; the front routes only to live replicas;
- **down**: exited or failed to start; respawned (on a new port) once its backoff has passed:
  `BACKOFF_S` doubled per consecutive failure, capped at the supervisor's `cap` (a replica that
  keeps failing keeps being retried at the cap, each try logged). A replica that stayed live for
  `STABLE_S` starts its count afresh.

Invariants: a replica's `url` and `proc` change together, and only while it is not live (the
front reads them); nothing is spawned after `Supervisor.stop`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from ..engine.exec.ranks import free_port
from ..env import EXIT_WITH_PARENT

log = logging.getLogger("deltaserve.replicas")

BACKOFF_S = 1.0  # the first restart's delay
BACKOFF_CAP_S = 60.0  # the longest delay between restarts
STABLE_S = 60.0  # a replica live this long has its consecutive-failure count reset
POLL_S = 0.2


def serve_command(argv: list[str], port: int) -> list[str]:
    """The command line of one replica server: `deltaserve serve` with `argv`, on `port`."""
    return [sys.executable, "-m", "deltaserve.cli", "serve", *argv, "--host", "127.0.0.1", "--port", str(port)]


@dataclass
class Replica:
    index: int
    command: object  # port -> argv of the replica's process
    url: str = ""
    proc: subprocess.Popen | None = None
    live: bool = False
    inflight: int = 0
    routed: int = 0
    restarts: int = 0  # processes started after the first
    failures: Counter = field(default_factory=Counter)  # by reason: "exited", "start_timeout"
    streak: int = 0  # consecutive failures
    deadline: float = 0.0  # while starting: when it is given up
    retry_at: float | None = None  # while down: when it is respawned
    live_since: float = 0.0
    last_failure: str = ""  # what its last failure was, for the log

    def spawn(self, start_timeout: float) -> None:
        port = free_port()
        env = dict(os.environ, **{EXIT_WITH_PARENT.name: "1"})  # a killed front takes its replicas along
        self.proc = subprocess.Popen(self.command(port), env=env)
        self.url, self.retry_at = f"http://127.0.0.1:{port}", None
        self.deadline = time.monotonic() + start_timeout

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def backoff(streak: int, cap: float = BACKOFF_CAP_S) -> float:
    """The delay before the restart that follows `streak` consecutive failures (>= 1)."""
    return min(cap, BACKOFF_S * 2.0 ** (streak - 1))


class Supervisor:
    """Starts `replicas` and keeps them running (see the module docstring)."""

    def __init__(self, replicas: list[Replica], start_timeout: float, cap: float = BACKOFF_CAP_S):
        self.replicas, self.start_timeout, self.cap = replicas, start_timeout, cap
        self.closing = False
        self.started = False  # `start` has returned: failures are logged as they happen
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Spawn every replica and wait (each up to `start_timeout`) until it answers or fails;
        the number live. Those that failed are logged (when some are live) and left to `run`'s
        restarts; with none live nothing is logged: `failed_start` says why in one line."""
        for r in self.replicas:
            r.spawn(self.start_timeout)
        waiting = list(self.replicas)
        while waiting:
            waiting = [r for r in waiting if self.step(r, time.monotonic()) == "starting"]
            time.sleep(POLL_S if waiting else 0)
        live = sum(r.live for r in self.replicas)
        for r in self.replicas:
            if live and not r.live:
                self._log_failure(r)
        self.started = True
        return live

    def failed_start(self) -> str:
        """Why each replica failed its first start, in one line."""
        return "; ".join(f"replica {r.index} {r.last_failure}" for r in self.replicas if not r.live)

    def step(self, r: Replica, now: float) -> str:
        """Advance `r` by one observation; its state after it."""
        with self._lock:
            if self.closing:
                return "closed"
            if r.live:
                if r.proc.poll() is None:
                    return "live"
                r.live = False
                self._failed(r, "exited", now)
                return "down"
            if r.retry_at is None:
                return self._starting(r, now)
            if now >= r.retry_at:
                log.warning("restarting replica %d (try %d)", r.index, r.streak + 1)
                r.restarts += 1
                r.spawn(self.start_timeout)
                return "starting"
            return "down"

    def _starting(self, r: Replica, now: float) -> str:
        if r.proc.poll() is not None:
            self._failed(r, "exited", now)
            return "down"
        if r.healthy():
            r.live, r.live_since = True, time.monotonic()
            log.info("replica %d (pid %d) is live at %s", r.index, r.proc.pid, r.url)
            return "live"
        if now > r.deadline:
            r.kill()
            self._failed(r, "start_timeout", now)
            return "down"
        return "starting"

    def _failed(self, r: Replica, reason: str, now: float) -> None:
        if r.live_since and now - r.live_since >= STABLE_S:
            r.streak = 0
        r.failures[reason] += 1
        r.streak += 1
        r.live_since = 0.0
        r.retry_at = now + backoff(r.streak, self.cap)
        if reason == "exited":
            r.last_failure = f"(pid {r.proc.pid}) exited with code {r.proc.returncode}"
        else:
            r.last_failure = f"(pid {r.proc.pid}) did not come up within {self.start_timeout:g} s"
        if self.started:
            self._log_failure(r)

    def _log_failure(self, r: Replica) -> None:
        delay = backoff(r.streak, self.cap)
        log.error("replica %d %s; restarting in %.3g s (failure %d in a row)", r.index, r.last_failure, delay, r.streak)

    def run(self) -> None:
        """Watch and restart the replicas on a daemon thread until `stop`."""

        def loop():
            while not self.closing:
                for r in self.replicas:
                    self.step(r, time.monotonic())
                time.sleep(POLL_S)

        self._thread = threading.Thread(target=loop, name="deltaserve-replicas", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 15.0) -> None:
        """No more restarts; every replica stopped (SIGTERM, then SIGKILL after `timeout` s)."""
        with self._lock:
            self.closing = True
        for r in self.replicas:
            r.live = False
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            try:
                if r.proc is not None:
                    r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.kill()
