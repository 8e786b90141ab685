"""`ShmCollectives`: all-reduce and all-gather for the ranks of one machine through a shared
memory segment, ~30 µs where gloo's TCP loopback takes ~1.3 ms (vLLM's CPU backend does the same).

Layout: one int64 flag per rank (each on its own 64-byte line), then two phases of one
`slot_bytes` slot per rank. Collective number s writes the rank's tensor into its slot of phase
s % 2, publishes s in its flag, waits until every flag reaches s, then reduces (or copies) all
slots of that phase in rank order, so every rank computes the identical result. A rank can only
write phase s % 2 again at s + 2, after every rank has published s + 1, i.e. finished reading s:
two phases suffice. x86 keeps stores in order, so a published flag implies its slot's data.

The segment is a /dev/shm file that rank 0 creates and unlinks once every rank has mapped it
(nothing is left behind if a rank dies). Tensors larger than a slot fall back to the process
group (every rank makes the same choice: sizes are equal). A wait longer than `timeout_s`, or
one `abort` ends, raises `RuntimeError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

FLAG_STRIDE = 8  # int64s per flag: one cache line
SPINS_BEFORE_YIELD = 200


class ShmCollectives:
    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float):
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        size = 8 * FLAG_STRIDE * world + 2 * world * slot_bytes
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        self._flags = torch.frombuffer(self._map, dtype=torch.int64, count=FLAG_STRIDE * world)[::FLAG_STRIDE]
        data = torch.frombuffer(self._map, dtype=torch.uint8, count=2 * world * slot_bytes, offset=64 * world)
        self._slots = data.view(2, world, slot_bytes)
        self._seq = 0
        self.abort_reason: str | None = None

    @classmethod
    def create(cls, rank: int, world: int, slot_bytes: int, timeout_s: float, group=None) -> "ShmCollectives | None":
        """Collective over `group` (None: the default group; `rank` / `world` are the group's): the
        segment if every rank of it runs on this machine (and /dev/shm exists), else None on every
        rank of it."""
        node = hashlib.sha256(os.uname().nodename.encode()).digest()
        host = torch.tensor([int.from_bytes(node[:7], "little")], dtype=torch.long)
        hosts = [torch.empty_like(host) for _ in range(world)]
        dist.all_gather(hosts, host, group=group)
        name = torch.zeros(64, dtype=torch.uint8)
        local = all(int(h) == int(host) for h in hosts) and Path("/dev/shm").is_dir()
        if local and rank == 0:
            path = f"/dev/shm/deltaserve-{uuid.uuid4().hex}"
            with open(path, "wb") as f:
                f.truncate(8 * FLAG_STRIDE * world + 2 * world * slot_bytes)
            name[: len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
        try:
            dist.broadcast(name, 0 if group is None else dist.get_global_rank(group, 0), group=group)
            path = bytes(name.tolist()).rstrip(b"\0").decode()
            if not path:
                return None
            shm = cls(path, rank, world, slot_bytes, timeout_s)
            dist.barrier(group=group)
        finally:  # once every rank mapped it (or one died trying), the name goes
            if local and rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return shm

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes and x.device.type == "cpu"

    def abort(self, reason: str) -> None:
        """Make every current and later wait raise (a rank is known dead)."""
        self.abort_reason = reason

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish `x`, wait for every rank's, return the phase's slots as [world, *x.shape]."""
        self._seq += 1
        n = x.numel() * x.element_size()
        phase = self._slots[self._seq % 2]
        phase[self.rank, :n].view(x.dtype).copy_(x.reshape(-1))
        self._flags[self.rank] = self._seq
        spins, deadline = 0, None
        while int(self._flags.min()) < self._seq:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                time.sleep(0)
                if self.abort_reason is not None:
                    raise RuntimeError(f"shared-memory collective aborted: {self.abort_reason}")
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise RuntimeError(f"a rank did not reach the collective within {self.timeout_s:g} s")
        return phase[:, :n].view(x.dtype).view(self.world, *x.shape)

    def all_reduce(self, x: torch.Tensor) -> None:
        """`x` becomes the sum over ranks (in place), summed in rank order on every rank."""
        torch.sum(self._exchange(x), dim=0, out=x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        parts = self._exchange(x)
        return torch.cat(parts.unbind(0), dim=dim)
