"""Which bytes each decode rank reads from which prefill rank, whatever the two instances'
tensor-parallel sizes (`plan_reads`).

With P prefill and D decode ranks the KDA heads are cut into B = lcm(P, D) head blocks (the
header's regions come in B/P blocks per prefill rank; the decode side lists its own in B/D);
block b lives on prefill rank b // (B/P) and on decode rank b // (B/D), the same bytes in the
same order on both (`cache.handoff.kda_regions`), so a decode rank reads each of its blocks from
the prefill rank holding it. The MLA latent rows are the same on every rank: each decode rank
reads them from one prefill rank (`mla_source`). Digests are keyed per MLA layer and per (KDA
layer, block) across the instance, so each decode rank's expected digests are the sources' own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cache.handoff import Region, digest_key, kda_regions
from ..cache.kda_pool import KdaStatePool
from ..engine.exec.messages import RankRead
from ..engine.exec.rank_transfer import Spans, spans
from .protocol import TransferHeader


def head_blocks(prefill_world: int, decode_world: int) -> int:
    """B: the head blocks a handoff between instances of these sizes moves."""
    return math.lcm(prefill_world, decode_world)


@dataclass(frozen=True)
class ReadPlan:
    reads: list[list[RankRead]]  # per decode rank
    regions: Spans  # every decode rank's own regions (the same offsets on each)
    blocks: int  # head blocks per decode rank
    expected: list[dict[str, str]]  # per decode rank: the digests its regions must hash to


def _grouped(regions: Spans) -> dict[tuple[int, int], Spans]:
    out: dict[tuple[int, int], Spans] = {}
    for r in regions:
        out.setdefault((r[1], r[4]), []).append(r)
    return out


def _remote(header: TransferHeader, s: int, regions: Spans) -> list[tuple[int, int]]:
    bases = header.ranks[s].bases
    return [(bases[t] + off, n) for t, _, off, n, _ in regions]


def plan_reads(
    header: TransferHeader, mla: list[Region], pool: KdaStatePool, slot: int, world: int, mla_source=None
) -> ReadPlan:
    """The reads and expected digests of every decode rank: `mla` (this side's MLA regions, the
    same on every rank), the KDA regions of `slot` of `pool` in this side's head blocks;
    `mla_source(r)`: the prefill rank decode rank r reads the MLA rows from (default r mod P).
    `ValueError` when the header's regions cannot pair with this side's."""
    p = len(header.ranks)
    b = head_blocks(p, world)
    bp, bd = b // p, b // world
    if header.blocks != bp:
        raise ValueError(f"{header.blocks} head blocks per prefill rank, {bp} expected")
    local_mla = spans(mla)
    remote_mla = [r for r in header.regions if r[0] == "mla"]
    if [(r[1], r[3]) for r in remote_mla] != [(r[1], r[3]) for r in local_mla]:
        raise ValueError("the MLA regions differ from the reservation's")
    local_kda, remote_kda = _grouped(spans(kda_regions(pool, slot, bd))), _grouped(header.regions[len(remote_mla) :])
    source = mla_source or (lambda r: r % p)
    reads, expected = [], []
    for r in range(world):
        s = source(r)
        by_peer: dict[int, tuple[list, Spans]] = {}
        if local_mla and s is not None:
            by_peer[s] = (_remote(header, s, remote_mla), list(local_mla))
        mla_digests = header.ranks[0 if s is None else s].digests
        want = {digest_key(Region(*x)): mla_digests.get(f"mla/{x[1]}", "") for x in local_mla}
        for (layer, j), mine in local_kda.items():
            g = r * bd + j
            src, theirs = g // bp, remote_kda.get((layer, g % bp), [])
            if [x[3] for x in theirs] != [x[3] for x in mine]:
                raise ValueError(f"KDA layer {layer} block {g} differs in shape")
            remote, local = by_peer.setdefault(src, ([], []))
            remote += _remote(header, src, theirs)
            local += mine
            want[f"kda/{layer}/{g}"] = header.ranks[src].digests.get(f"kda/{layer}/{g}", "")
        reads.append([RankRead(header.ranks[k].session, rem, loc) for k, (rem, loc) in sorted(by_peer.items())])
        expected.append(want)
    regions = local_mla + [x for group in local_kda.values() for x in group]
    return ReadPlan(reads, regions, bd, expected)
