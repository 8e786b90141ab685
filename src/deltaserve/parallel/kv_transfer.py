"""KV transfer engines (prefill/decode handoffs) behind one small interface: register pool
tensors, read peers' bytes in place. One per process: under tensor parallelism every rank runs
its own and moves its own pools' bytes (`engine.exec.rank_transfer`).

`Connector.read` moves each remote region into the matching local one (same lengths, one batch)
and returns the byte count; it raises `TransferError` when the peer is gone or refuses. Memory is
read where it lies (registered pool tensors on both sides), never serialized.

`MooncakeConnector` (the tested default) uses the Mooncake Transfer Engine with the P2P
handshake (no metadata server) over TCP or RDMA (`protocol`, `serve --kv-transfer-protocol`; RDMA
is refused where the machine lists no RDMA device, Mooncake picks the devices itself; only TCP is
tested here, the machines have no RDMA NIC); `mooncake-transfer-engine-non-cuda` needs Debian's
`libibverbs1` and `librdmacm1`. A NIXL connector would sit beside it (nixl-cu12 pulls ~5.7 GB of
CUDA wheels, so it is not built here). Neither engine authenticates its data plane: run the
instances on a trusted network; the control plane (`disagg/protocol.py`) carries the shared secret.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

import torch

log = logging.getLogger(__name__)
PROTOCOLS = ("tcp", "rdma")
RDMA_SYSFS = "/sys/class/infiniband"


class TransferError(RuntimeError):
    """A transfer failed (peer gone, region refused, engine error)."""


class Connector:
    """One per process: `register` pool tensors once, then `read` from peers' sessions."""

    name = "none"

    @property
    def session(self) -> str:
        raise NotImplementedError

    def register(self, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
        """Register each tensor's memory; returns name -> base address."""
        raise NotImplementedError

    def read(self, session: str, remote: list[tuple[int, int]], local: list[int]) -> int:
        """Read `(address, length)` regions of `session` into the `local` addresses; bytes moved."""
        raise NotImplementedError


class MooncakeConnector(Connector):
    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = ""):
        check_protocol(protocol)
        os.environ.setdefault("GLOG_minloglevel", "2")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransferError(
                "the Mooncake transfer engine is not installed: pip install mooncake-transfer-engine-non-cuda "
                "(and apt-get install libibverbs1 librdmacm1)"
            ) from e
        self._te = TransferEngine()
        if self._te.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise TransferError(f"Mooncake transfer engine failed to start on {host} over {protocol}")
        self._session = f"{host}:{self._te.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []

    @property
    def session(self) -> str:
        return self._session

    def register(self, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
        bases = {}
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise ValueError(f"pool tensor {name} is not contiguous")
            if t.device.type != "cpu" and _host_memory_only():
                raise TransferError(
                    f"pool tensor {name} lives on {t.device}, and the installed Mooncake build "
                    "(mooncake-transfer-engine-non-cuda) reads host memory only: install the CUDA build "
                    "(pip install mooncake-transfer-engine) to hand off device pools"
                )
            if self._te.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                raise TransferError(f"Mooncake could not register pool tensor {name}")
            self._registered.append(t)
            bases[name] = t.data_ptr()
        return bases

    def read(self, session: str, remote: list[tuple[int, int]], local: list[int]) -> int:
        if not remote:
            return 0
        src, dst, lengths = coalesce(remote, local)
        if self._te.batch_transfer_sync_read(session, dst, src, lengths) != 0:
            raise TransferError(f"reading {len(remote)} regions from {session} failed")
        return sum(lengths)


def _host_memory_only() -> bool:
    """Whether the installed Mooncake is the build without CUDA (its device pointers are not
    memory it can read)."""
    try:
        importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def coalesce(remote: list[tuple[int, int]], local: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(sources, destinations, lengths) with each run of regions adjacent on both sides merged
    (consecutive pages of one layer usually are): fewer, larger transfers, the same bytes."""
    src, dst, lengths = [remote[0][0]], [local[0]], [remote[0][1]]
    for (a, n), b in zip(remote[1:], local[1:]):
        if a == src[-1] + lengths[-1] and b == dst[-1] + lengths[-1]:
            lengths[-1] += n
        else:
            src.append(a)
            dst.append(b)
            lengths.append(n)
    return src, dst, lengths


def rdma_devices(root: str | None = None) -> list[str]:
    """The RDMA devices this machine lists (`/sys/class/infiniband`: mlx5_0, ...), sorted."""
    try:
        return sorted(os.listdir(root or RDMA_SYSFS))
    except OSError:
        return []


def check_protocol(protocol: str) -> None:
    """Refuse an unknown protocol, and RDMA on a machine without an RDMA device (`TransferError`)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown KV transfer protocol {protocol!r} (available: {', '.join(PROTOCOLS)})")
    if protocol == "rdma" and not rdma_devices():
        raise TransferError(
            f"--kv-transfer-protocol rdma needs an RDMA device and this machine lists none ({RDMA_SYSFS} is "
            "empty or absent): install the NIC's driver, or use --kv-transfer-protocol tcp"
        )


def make_connector(kind: str, host: str, protocol: str = "tcp") -> Connector:
    if kind == "mooncake":
        return MooncakeConnector(host, protocol)
    raise ValueError(f"unknown transfer engine {kind!r} (available: mooncake)")
