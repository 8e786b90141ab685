"""A prefill/decode handoff on every rank of an instance: each moves its own pools' bytes.

A tensor-parallel instance's ranks hold the same MLA latent rows and each its share of the KDA
heads; heads divide evenly, so every rank's pools have the same shapes and a handoff's regions
(`cache.handoff`: offsets and lengths, KDA heads in blocks) are the same on every rank, over
other addresses and other bytes. So each rank runs a transfer engine of its own
(`RankTransfer`), and each rank of a decode instance reads its own regions from whichever peers
hold them (`RankRead`s: the prefill rank holding each head block, and the MLA rows from one
source; `disagg.plan`), whatever the two instances' sizes.

Reads and hashes are jobs on a small thread pool of each rank, beside its steps (their regions
are parked or reserved: no step writes them). Rank 0 starts a job on every rank (`start_job`:
a `Digest` or `Pull` control message between steps; a `Pull` first replays the slot writes
made since the last step, so the reservation's zeroing cannot land after the bytes) and later
collects it (`collect_job`: a `Collect`, each rank waits for its job and answers through
`ControlChannel.gather`, msgpack). Both run on rank 0's engine thread and are brief; the wait
in between is the caller's. A failed read on any rank is an answer, not a crash: the handoff
fails closed and the ranks go on. Every started job must be collected before the regions are
given back (`collect_job` of an unknown job answers an error and waits for nothing). A job
still running at its deadline is `stuck`: its bytes may yet land, so its regions cannot be
given back, and the caller stops the instance instead.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from ... import env
from ...cache.handoff import Region, pool_tensors, region_digests
from ...parallel.kv_transfer import Connector, TransferError, make_connector
from .messages import Collect, Digest, Pull, RankRead, TransferSetup
from .ranks import RankFailure

Spans = list[tuple[str, int, int, int, int]]  # regions as (tensor, layer, offset, length, block)
HOST_ENV = env.KV_TRANSFER_HOST.name  # the address this node's ranks advertise (serve --kv-transfer-host)


class RankEndpoint(msgspec.Struct, frozen=True):
    """Where a peer reads a rank's pools: its transfer session and pool base addresses."""

    session: str
    bases: dict[str, int]
    error: str = ""  # the transfer engine did not start


class RankReceipt(msgspec.Struct, frozen=True):
    """A rank's answer to a read or a hash: the bytes moved and the digests, or why not; `stuck`:
    the job was still running when the wait ended (its bytes may still land)."""

    moved: int = 0
    digests: dict[str, str] = {}
    error: str = ""
    stuck: bool = False


def spans(regions: list[Region]) -> Spans:
    return [(r.tensor, r.layer, r.offset, r.length, r.block) for r in regions]


class RankTransfer:
    """One process's transfer engine over the pool tensors it registered (`pool_tensors`), and
    its jobs by id."""

    def __init__(self, connector: Connector, tensors: dict):
        self.connector, self.tensors = connector, tensors
        self.bases = connector.register(tensors)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-transfer")
        self._jobs: dict[int, Future] = {}

    @classmethod
    def start(
        cls, engine: str, host: str, tensors: dict, protocol: str = "tcp"
    ) -> "tuple[RankTransfer | None, RankEndpoint]":
        """(the started transfer, its endpoint), or (None, an endpoint saying why it did not start)."""
        try:
            transfer = cls(make_connector(engine, host, protocol), tensors)
        except Exception as e:  # any failure is an answer: every rank must reach the gather
            return None, RankEndpoint("", {}, f"{type(e).__name__}: {e}")
        return transfer, transfer.endpoint()

    def endpoint(self) -> RankEndpoint:
        return RankEndpoint(self.connector.session, dict(self.bases))

    def digests(self, regions: Spans, first_block: int = 0) -> RankReceipt:
        return RankReceipt(0, region_digests(self.tensors, [Region(*r) for r in regions], first_block))

    def read(self, reads: list[RankRead]) -> RankReceipt:
        """Each read's `remote` from its session into its `regions` of this rank's pools; the
        bytes moved, or the first error (nothing further is read)."""
        size = {k: t.numel() * t.element_size() for k, t in self.tensors.items()}
        moved = 0
        for rd in reads:
            if len(rd.remote) != len(rd.regions) or any(n != r[3] for (_, n), r in zip(rd.remote, rd.regions)):
                return RankReceipt(moved, error="remote regions differ from the local ones")
            if any(t not in size or off < 0 or n < 0 or off + n > size[t] for t, _, off, n, _ in rd.regions):
                return RankReceipt(moved, error="a region lies outside this rank's pools")
            try:
                local = [self.bases[t] + off for t, _, off, _, _ in rd.regions]
                moved += self.connector.read(rd.session, list(rd.remote), local)
            except TransferError as e:
                return RankReceipt(moved, error=f"{type(e).__name__}: {e}")
        return RankReceipt(moved)

    def submit(self, msg: Digest | Pull, rank: int) -> Future:
        """Start `msg` as job `msg.job` (rank `rank`'s share)."""
        if isinstance(msg, Digest):
            fut = self._pool.submit(self.digests, msg.regions, rank * msg.blocks)
        else:
            fut = self._pool.submit(self.read, msg.reads[rank])
        self._jobs[msg.job] = fut
        return fut

    def collect(self, job: int, wait_s: float) -> RankReceipt:
        """Job `job`'s receipt once it is done, waiting up to `wait_s`; never raises (every rank
        must reach the gather that follows): an unknown, cancelled or failed job is an error
        receipt, one still running a stuck one."""
        fut = self._jobs.pop(job, None)
        if fut is None:
            return RankReceipt(error=f"no transfer job {job} on this rank")
        try:
            return fut.result(timeout=wait_s)
        except TimeoutError:
            return RankReceipt(error=f"transfer job {job} still running after {wait_s:.0f} s", stuck=True)
        except Exception as e:
            return RankReceipt(error=f"transfer job {job} failed: {type(e).__name__}: {e}")


def serve_transfer(msg, channel, tensors: dict, ops, transfer: RankTransfer | None) -> RankTransfer | None:
    """A worker's side of the transfer messages (`ops(list)` replays slot writes); returns the
    rank's transfer (started by `TransferSetup`)."""
    if isinstance(msg, TransferSetup):  # a rank on another node advertises that node's own address
        host = env.KV_TRANSFER_HOST.get() or msg.host
        transfer, endpoint = RankTransfer.start(msg.engine, host, tensors, msg.protocol)
        _answer(channel, endpoint)
        return transfer
    if transfer is None:
        raise RankFailure(f"rank {channel.rank}: {type(msg).__name__} without a transfer engine")
    if isinstance(msg, Collect):
        _answer(channel, transfer.collect(msg.job, msg.wait_s))
        return transfer
    if isinstance(msg, Pull):
        ops(msg.ops)
    transfer.submit(msg, channel.rank)
    return transfer


_enc = msgspec.msgpack.Encoder()


def _answer(channel, reply) -> list[bytes]:
    return channel.gather(_enc.encode(reply))


def _answers(channel, own, kind: type) -> list:
    if channel is None:
        return [own]
    return [msgspec.msgpack.decode(b, type=kind) for b in _answer(channel, own)]


def setup_transfer(core, engine: str, host: str, protocol: str = "tcp") -> list[RankEndpoint]:
    """Start every rank's transfer engine over `protocol` (rank 0's is kept as `core.runner.transfer`)."""
    runner = core.runner
    if runner.channel is not None:
        runner.channel.send(TransferSetup(engine, host, protocol))
    tensors = pool_tensors(core.cache.mla, core.cache.kda)
    runner.transfer, endpoint = RankTransfer.start(engine, host, tensors, protocol)
    return _answers(runner.channel, endpoint, RankEndpoint)


def start_job(core, msg: Digest | Pull) -> Future:
    """Start `msg` on every rank; returns rank 0's job (a `Pull` takes the slot writes made since
    the last step along)."""
    runner = core.runner
    if isinstance(msg, Pull) and runner.journal is not None:
        msg = msgspec.structs.replace(msg, ops=runner.journal.take())
    if runner.channel is not None:
        runner.channel.send(msg)
    return runner.transfer.submit(msg, 0)


def collect_job(core, job: int, wait_s: float) -> list[RankReceipt]:
    """Every rank's receipt of job `job`, rank 0's first (each waits up to `wait_s` for its job)."""
    runner = core.runner
    if runner.channel is not None:
        runner.channel.send(Collect(job, wait_s))
    return _answers(runner.channel, runner.transfer.collect(job, wait_s), RankReceipt)
