"""`ControlChannel`: rank 0 broadcasts encoded `messages` to every rank over a torch.distributed
group (gloo, also when the model's collectives run on NCCL).

The sender is the group's rank 0 (`src` is a rank of the group; a wide expert-parallel replica's
control group is a subgroup, whose rank 0 is not global rank 0). One broadcast of a fixed
`FRAME`-byte buffer carries the length and, when it fits (every decode step of a normal batch), the
whole message; a longer one follows in a second broadcast. The buffer holds raw bytes only;
torch.distributed's object collectives (which serialize Python objects unsafely) are never used.
`gather` is the way back: every rank's reply bytes to every rank (two all-gathers: the lengths,
then the bytes padded to the longest).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...parallel import COMM
from . import messages

FRAME = 8192
_HEADER = 8


class ControlChannel:
    def __init__(self, group=None, src: int = 0):
        self.group = group
        self.src = src if group is None else dist.get_global_rank(group, src)
        self._frame = torch.zeros(FRAME, dtype=torch.uint8)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def send(self, msg: messages.Message) -> None:
        data = messages.encode(msg)
        n = len(data)
        frame = self._frame
        frame[:_HEADER] = torch.tensor(list(n.to_bytes(_HEADER, "little")), dtype=torch.uint8)
        head = min(n, FRAME - _HEADER)
        frame[_HEADER : _HEADER + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        with COMM.timed():
            dist.broadcast(frame, self.src, group=self.group)
            if n > head:
                rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
                dist.broadcast(rest, self.src, group=self.group)

    def recv(self) -> messages.Message:
        frame = self._frame
        dist.broadcast(frame, self.src, group=self.group)
        raw = frame.numpy().tobytes()
        n = int.from_bytes(raw[:_HEADER], "little")
        head = min(n, FRAME - _HEADER)
        data = raw[_HEADER : _HEADER + head]
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            dist.broadcast(rest, self.src, group=self.group)
            data += rest.numpy().tobytes()
        return messages.decode(data)

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (a collective: every rank of the group calls it)."""
        world = dist.get_world_size(self.group)
        n = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(lengths, n, group=self.group)
        size = max(1, *(int(t) for t in lengths))
        buf = torch.zeros(size, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(size, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(parts, buf, group=self.group)
        return [p[: int(m)].numpy().tobytes() for p, m in zip(parts, lengths)]
