"""A `mooncake_master` on free loopback ports for the shared-tier tests (skipped, with the reason,
where the binary or the store client's libraries are missing)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> Path:
    """The package's `mooncake_master`; skips when it or the store client cannot load."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        import mooncake
        import mooncake.store  # noqa: F401  (needs libibverbs1, librdmacm1)
    except ImportError as e:
        pytest.skip(f"the Mooncake store client does not import here: {e}")
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"no executable mooncake_master at {binary}")
    return binary


class Master:
    """One master process: `url` for `--kv-store`, `stop()` ends it (idempotent)."""

    def __init__(self, log: Path):
        self.port = free_port()
        args = [
            str(master_binary()),
            f"-rpc_port={self.port}",
            "-rpc_address=127.0.0.1",
            f"-metrics_port={free_port()}",
            "-enable_metric_reporting=false",
        ]
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60  # one loaded core: allow for a slow start
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not start: see {log}") from None
                time.sleep(0.1)
        self.url = f"mooncake://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
