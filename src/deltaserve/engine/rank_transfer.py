"""A prefill/decode handoff on every rank of an instance: each moves its own pools' bytes.

A tensor-parallel instance's ranks hold the same MLA latent rows and each its share of the KDA
heads; heads divide evenly, so every rank's pools have the same shapes and a handoff's regions
(`cache.handoff`: offsets and lengths) are the same on every rank, over other addresses and
other bytes. So each rank runs a transfer engine of its own (`RankTransfer`), and rank r of a
decode instance reads from rank r of the prefill instance. Rank 0 drives the others with
control messages between steps (`TransferSetup`, `Digest`, `Pull`) and collects their answers
(`ControlChannel.gather`, msgpack): the functions below run on rank 0's engine thread and
return one answer per rank, rank 0's first. A failed read on any rank is an answer, not a
crash: the handoff fails closed and the ranks go on.
"""

from __future__ import annotations

import msgspec

from ..cache.handoff import Region, pool_tensors, region_digests
from ..parallel.kv_transfer import Connector, TransferError, make_connector
from .messages import Digest, Pull, TransferSetup

Spans = list[tuple[str, int, int, int]]  # regions as (tensor, layer, offset, length)


class RankEndpoint(msgspec.Struct, frozen=True):
    """Where a peer reads a rank's pools: its transfer session and pool base addresses."""

    session: str
    bases: dict[str, int]
    error: str = ""  # the transfer engine did not start


class RankReceipt(msgspec.Struct, frozen=True):
    """A rank's answer to a read or a hash: the bytes moved and the digests, or why not."""

    moved: int = 0
    digests: list[str] = []
    error: str = ""


def spans(regions: list[Region]) -> Spans:
    return [(r.tensor, r.layer, r.offset, r.length) for r in regions]


def _regions(s: Spans) -> list[Region]:
    return [Region(*r) for r in s]


class RankTransfer:
    """One process's transfer engine over the pool tensors it registered (`pool_tensors`)."""

    def __init__(self, connector: Connector, tensors: dict):
        self.connector, self.tensors = connector, tensors
        self.bases = connector.register(tensors)

    @classmethod
    def start(cls, engine: str, host: str, tensors: dict) -> "RankTransfer | RankEndpoint":
        """A started transfer, or the endpoint answer saying why it did not start."""
        try:
            return cls(make_connector(engine, host), tensors)
        except (TransferError, ValueError) as e:
            return RankEndpoint("", {}, str(e))

    def endpoint(self) -> RankEndpoint:
        return RankEndpoint(self.connector.session, dict(self.bases))

    def digests(self, regions: Spans) -> RankReceipt:
        return RankReceipt(0, region_digests(self.tensors, _regions(regions)))

    def read(self, session: str, remote: list[tuple[int, int]], regions: Spans) -> RankReceipt:
        """Read `remote` from `session` into `regions` of this rank's pools."""
        if len(remote) != len(regions) or any(n != r[3] for (_, n), r in zip(remote, regions)):
            return RankReceipt(error="remote regions differ from the local ones")
        try:
            local = [self.bases[t] + off for t, _, off, _ in regions]
            return RankReceipt(self.connector.read(session, list(remote), local))
        except (TransferError, KeyError) as e:
            return RankReceipt(error=f"{type(e).__name__}: {e}")


def serve_transfer(msg, channel, tensors: dict, ops, transfer: RankTransfer | None) -> RankTransfer | None:
    """A worker's side of `TransferSetup`, `Digest` and `Pull` (`ops(list)` replays slot writes);
    returns the rank's transfer (started by `TransferSetup`)."""
    if isinstance(msg, TransferSetup):
        started = RankTransfer.start(msg.engine, msg.host, tensors)
        transfer = started if isinstance(started, RankTransfer) else None
        _answer(channel, started.endpoint() if transfer is not None else started)
        return transfer
    if isinstance(msg, Pull):
        ops(msg.ops)
    if transfer is None:
        receipt = RankReceipt(error="this rank has no transfer engine")
    elif isinstance(msg, Digest):
        receipt = transfer.digests(msg.regions)
    else:
        r = channel.rank
        receipt = transfer.read(msg.sessions[r], msg.remote[r], msg.regions)
    _answer(channel, receipt)
    return transfer


_enc = msgspec.msgpack.Encoder()


def _answer(channel, reply) -> list[bytes]:
    return channel.gather(_enc.encode(reply))


def _answers(channel, own, kind: type) -> list:
    if channel is None:
        return [own]
    return [msgspec.msgpack.decode(b, type=kind) for b in _answer(channel, own)]


def setup_transfer(core, engine: str, host: str) -> list[RankEndpoint]:
    """Start every rank's transfer engine (rank 0's is kept as `core.runner.transfer`)."""
    runner = core.runner
    if runner.channel is not None:
        runner.channel.send(TransferSetup(engine, host))
    started = RankTransfer.start(engine, host, pool_tensors(core.cache.mla, core.cache.kda))
    runner.transfer = started if isinstance(started, RankTransfer) else None
    own = started.endpoint() if runner.transfer is not None else started
    return _answers(runner.channel, own, RankEndpoint)


def rank_digests(core, regions: Spans) -> list[RankReceipt]:
    """Every rank's digests of `regions` of its pools."""
    runner = core.runner
    if runner.channel is not None:
        runner.channel.send(Digest(regions))
    return _answers(runner.channel, runner.transfer.digests(regions), RankReceipt)


def rank_read(core, sessions: list[str], remote: list[list[tuple[int, int]]], regions: Spans) -> list[RankReceipt]:
    """Every rank r reads `remote[r]` from `sessions[r]` into `regions` of its pools, after the
    slot writes rank 0 made since the last step (the reservation's zeroed slot)."""
    runner = core.runner
    if runner.channel is not None:
        runner.channel.send(Pull(runner.journal.take(), sessions, remote, regions))
    own = runner.transfer.read(sessions[0], remote[0], regions)
    return _answers(runner.channel, own, RankReceipt)
