"""The Mooncake Store client under the shared tier (`--kv-store mooncake://HOST:PORT`).

`HOST:PORT` is a `mooncake_master`'s RPC address. The client joins over TCP with the P2P
handshake (no metadata server, as the PD transfer engine does), advertising the local address
it reaches the master from, and lends `lend` bytes of host memory to the store as its segment
(0: none; objects then live in other clients' segments: other engines' or `mooncake_client`
storage nodes'). Objects in a segment go away with the client that lent it.

Values are written from and read into plain host buffers (`put_from` / `get_into`: no local
transfer buffer is needed over TCP, so an object's size is bounded only by the segments).

Every call blocks on the network (seconds when the master is gone), so only the shared tier's
own threads call it. Results: `put` and `remove` give Mooncake's code (0 = done), `get` the bytes
or None when the key is absent, `exists` 1 / 0 per key; a failed RPC (the master unreachable)
raises `StoreDown`, a `get` whose bytes cannot be transferred (their segment's owner is gone)
`Unreadable`. Startup fails fast with `StoreUnavailable` when no master answers.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
from urllib.parse import urlsplit

log = logging.getLogger(__name__)
NOT_FOUND = -704  # OBJECT_NOT_FOUND
TRANSFER_FAIL = -800  # the bytes' transfer from the segment holding them failed
RPC_FAIL = -900
SETUP_TIMEOUT_S = 30.0


class StoreUnavailable(RuntimeError):
    """The store cannot be joined at startup (no master, package missing, setup refused)."""


class StoreDown(RuntimeError):
    """An RPC to the master failed mid-run (it is gone or unreachable)."""


class Unreadable(RuntimeError):
    """One object's bytes could not be read though the master lists it (the instance whose
    segment holds them is gone: the master lists its objects until its lease ends)."""


def parse_url(url: str) -> tuple[str, int]:
    """(host, port) of `mooncake://HOST:PORT`; ValueError for anything else."""
    hint = f"--kv-store {url!r}: expected mooncake://HOST:PORT (a mooncake_master's RPC address)"
    try:
        u = urlsplit(url)
        host, port = u.hostname, u.port
    except ValueError:
        raise ValueError(hint) from None
    if u.scheme != "mooncake" or not host or port is None or u.path not in ("", "/") or u.query or u.fragment:
        raise ValueError(hint)
    return host, port


def _local_address(host: str, port: int, timeout: float) -> str:
    """The address this machine reaches the master from (its peers read our segment there)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            return s.getsockname()[0]
    except OSError as e:
        raise StoreUnavailable(f"--kv-store mooncake://{host}:{port}: no Mooncake master answers ({e})") from None


def _addr(buf: bytes | bytearray) -> int:
    if isinstance(buf, bytearray):
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value


class MooncakeClient:
    def __init__(self, url: str, lend: int = 0, timeout: float = 5.0):
        host, port = parse_url(url)
        local = _local_address(host, port, timeout)
        os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: warnings and up
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StoreUnavailable(
                f"--kv-store needs the Mooncake store client: pip install mooncake-transfer-engine-non-cuda "
                f"(and apt-get install libibverbs1 librdmacm1): {e}"
            ) from None
        self.store = MooncakeDistributedStore()
        config = {
            "local_hostname": local,
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": int(lend),
            "local_buffer_size": 0,
            "protocol": "tcp",
            "rdma_devices": "",
            "master_server_addr": f"{host}:{port}",
        }
        done: list[int] = []
        t = threading.Thread(target=lambda: done.append(self.store.setup(config)), daemon=True)
        t.start()
        t.join(SETUP_TIMEOUT_S)
        if not done or done[0] != 0:
            why = f"setup returned {done[0]}" if done else f"no answer in {SETUP_TIMEOUT_S:.0f} s"
            raise StoreUnavailable(f"--kv-store {url}: joining the Mooncake store failed ({why})")
        self.url, self.closed = url, False
        log.info("shared tier: Mooncake store at %s:%d joined from %s, lending %d bytes", host, port, local, lend)

    def put(self, key: str, data: bytes) -> int:
        rc = self.store.put_from(key, _addr(data), len(data))
        if rc == RPC_FAIL:
            raise StoreDown(f"put {key}: RPC failed")
        return rc

    def get(self, key: str) -> bytes | None:
        n = self.store.get_size(key)
        if n == NOT_FOUND:
            return None
        if n < 0:
            raise StoreDown(f"get {key}: size query failed ({n})")
        buf = bytearray(n)
        rc = self.store.get_into(key, _addr(buf), n) if n else 0
        if rc == NOT_FOUND:
            return None  # evicted between the two calls
        if rc == TRANSFER_FAIL:
            raise Unreadable(f"get {key}: its segment did not answer ({rc})")
        if rc < 0:
            raise StoreDown(f"get {key}: read failed ({rc})")
        return bytes(buf[:rc])

    def exists(self, keys: list[str]) -> list[int]:
        codes = self.store.batch_is_exist(keys)
        if any(c < 0 for c in codes):
            raise StoreDown("existence query failed")
        return list(codes)

    def remove(self, key: str) -> int:
        return self.store.remove(key, True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.store.close()
