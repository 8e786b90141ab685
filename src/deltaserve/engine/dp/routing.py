"""Routing over engine replicas, shared by the offline `LLM`'s data-parallel client
(engine/dp/client.py) and `deltaserve serve --data-parallel-size`'s front.

`Router` routes on resumable prefixes: the replicas publish where a boundary can resume
(`cache.events`), a `ResumeIndex` keeps it, and a request goes where the longest prefix of its
hash chain resumes, weighted by tier, minus load, with session affinity (see `Router`).
`rendezvous` / `pick` are the prefix-affine hashing it falls back on among equals.

Invariants: `rendezvous(key, n)` depends only on `key` and `n` (the same key always lands on
the same replica); `pick` keeps that replica unless it is more than `spill` requests busier than
the least loaded one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...cache.events import TIERS, CacheEvents, short
from ...cache.hashing import extend_hashes, root_hash

SPILL = 4  # in-flight requests a prefix-affine replica may exceed the least loaded one by


def rendezvous(key: bytes, n: int) -> int:
    """The replica in [0, n) whose hash with `key` is highest (rendezvous hashing)."""
    return rendezvous_among(key, range(n))


def rendezvous_among(key: bytes, candidates: Iterable[int]) -> int:
    """The replica among `candidates` whose hash with `key` is highest: a key keeps its replica
    while that one is a candidate, and only the keys of a missing one move."""
    return max(candidates, key=lambda i: _rank(key, i))


def pick(key: bytes, loads: Sequence[int], spill: int = SPILL, among: Sequence[int] | None = None) -> int:
    """`key`'s rendezvous replica (of `among`, default all) unless its load exceeds the least
    one's by more than `spill`: then the least loaded (the lowest index among equals)."""
    among = range(len(loads)) if among is None else among
    home = rendezvous_among(key, among)
    least = min(among, key=loads.__getitem__)
    return home if loads[home] <= loads[least] + spill else least


def token_key(prompt_ids: Sequence[int], cache_salt: str | None, unit: int) -> bytes:
    """The routing key of a tokenized prompt: its salt and first `unit` tokens (the prefix
    cache's hit granularity: prompts that share less can share no cached prefix)."""
    head = array("q", prompt_ids[:unit]).tobytes()
    return (cache_salt or "").encode() + b"\0" + head


def prompt_hashes(ids: Sequence[int], model_id: str, cache_salt: str | None, unit: int) -> list[bytes]:
    """The chain hashes a replica's prefix lookup computes for a text prompt of `ids` (every
    whole unit before its last token)."""
    limit = (len(ids) - 1) // unit
    return extend_hashes([], root_hash(model_id, cache_salt), list(ids[: limit * unit]), unit)


TIER_WEIGHT = (1.0, 0.75, 0.5)  # a resumable prefix's worth by tier (`cache.events.TIERS`): device, host, disk
LOAD_WEIGHT = 0.1  # score one request in flight (running or waiting) costs; a whole prompt resumed is 1.0
INDEX_CAP = 1 << 18  # boundaries a `ResumeIndex` remembers (least recently stored or used go first)
SESSIONS_CAP = 1 << 16  # sessions a `Router` remembers
REASONS = ("affinity", "resume_device", "resume_host", "resume_disk", "load", "hash")


def best_resume(lengths: dict[int, int]) -> tuple[int, int]:
    """(k, tier) of the resumable prefix worth most, of `lengths` (tier code -> k resumable
    there; k > 0), weighed by `TIER_WEIGHT`; (0, 0) for none."""
    return max(((k, t) for t, k in lengths.items() if k), key=lambda kt: TIER_WEIGHT[kt[1]] * kt[0], default=(0, 0))


def resume_score(k: int, tier: int, n: int, load: int) -> float:
    """A replica's worth for a request of `n` units, `k` of them resumable there from `tier`,
    with `load` requests in flight: `TIER_WEIGHT[tier] * k / n - LOAD_WEIGHT * load`. The DP
    router's and `deltaserve proxy`'s prefill choice share it (tokens or units alike)."""
    return (TIER_WEIGHT[tier] * k / n if k and n else 0.0) - LOAD_WEIGHT * load


class ResumeIndex:
    """Where each boundary is resumable, as the replicas' `cache.events` say: short chain hash ->
    {replica: bitmask of tier codes}. Bounded by `cap` keys (LRU). Invariant: after `apply` of
    every batch a replica drained, in order, its entries are what it holds (but keys the cap
    dropped); after `forget(i)` nothing names replica i."""

    def __init__(self, cap: int = INDEX_CAP):
        self.cap = cap
        self.held: OrderedDict[bytes, dict[int, int]] = OrderedDict()

    def apply(self, replica: int, batch: CacheEvents) -> None:
        if batch.reset:
            self.forget(replica)
        for e in batch.events:
            where = self.held.get(e.key)
            if e.stored:
                if where is None:
                    where = self.held[e.key] = {}
                    while len(self.held) > self.cap:
                        self.held.popitem(last=False)
                else:
                    self.held.move_to_end(e.key)
                where[replica] = where.get(replica, 0) | 1 << e.tier
            elif where is not None and replica in where:
                where[replica] &= ~(1 << e.tier)
                if not where[replica]:
                    del where[replica]
                if not where:
                    del self.held[e.key]

    def forget(self, replica: int) -> None:
        """Drop every entry of `replica` (it died, or resets what it published)."""
        for key in [k for k, where in self.held.items() if where.pop(replica, None) is not None and not where]:
            del self.held[key]

    def count(self, replica: int) -> int:
        return sum(replica in where for where in self.held.values())

    def longest(self, hashes: Sequence[bytes], among: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Per replica of `among` holding some boundary of `hashes`: (k, tier) of its best, the
        longest in each tier weighed by `TIER_WEIGHT` (k units resumable from that tier). Marks
        what it finds most recently used."""
        seen: dict[int, dict[int, int]] = {}  # replica -> tier -> longest k
        for k in range(len(hashes), 0, -1):
            key = short(hashes[k - 1])
            where = self.held.get(key)
            if where is None:
                continue
            self.held.move_to_end(key)
            for i, mask in where.items():
                if i in among:
                    tiers = seen.setdefault(i, {})
                    for t in range(len(TIERS)):
                        if mask >> t & 1:
                            tiers.setdefault(t, k)
            if len(seen) == len(among) and all(0 in t for t in seen.values()):
                break  # a device boundary: nothing shorter weighs more
        return {i: best_resume(ts) for i, ts in seen.items()}


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # one of `REASONS`
    resumed: int = 0  # units resumable there


class Router:
    """Picks the replica a request goes to, from what the replicas published (`index`), their
    loads and the request's session:
    - a named session (`prompt_cache_key`, else `cache_salt`) stays where it went before while that
      replica is live and at most `SPILL` requests busier than the least loaded ("affinity");
    - else the highest `TIER_WEIGHT[tier] * k / n - LOAD_WEIGHT * load` over the live replicas,
      k of the prompt's n units resumable there ("resume_<tier>" when that replica resumes some);
    - with nothing resumable anywhere, `pick`: the key's rendezvous replica ("hash") unless it is
      over `spill` busier than the least loaded, which then takes it ("load"); likewise "load"
      when load outweighs every resumable prefix. Equal scores go to the lower load, then the
      rendezvous order."""

    def __init__(self, index_cap: int = INDEX_CAP, sessions_cap: int = SESSIONS_CAP):
        self.index = ResumeIndex(index_cap)
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.sessions_cap = sessions_cap
        self.decisions: Counter[str] = Counter()

    def forget(self, replica: int) -> None:
        self.index.forget(replica)
        for s in [s for s, i in self.sessions.items() if i == replica]:
            del self.sessions[s]

    def route(
        self,
        key: bytes,
        hashes: Sequence[bytes],
        loads: Sequence[int],
        among: Sequence[int],
        session: str | None = None,
        spill: int = SPILL,
    ) -> Route:
        """Where a request goes: `key` its rendezvous key, `hashes` its prompt's chain hashes
        (`cache.hashing`, as the replicas' lookup computes them), `loads` indexed by replica."""
        route = self._choose(key, hashes, loads, among, session, spill)
        self.decisions[route.reason] += 1
        if session:
            self.sessions[session] = route.replica
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.sessions_cap:
                self.sessions.popitem(last=False)
        return route

    def _choose(self, key, hashes, loads, among, session, spill) -> Route:
        least = min(loads[i] for i in among)
        home = self.sessions.get(session) if session else None
        if home is not None and home in among and loads[home] <= least + spill:
            return Route(home, "affinity")
        found = self.index.longest(hashes, among) if hashes else {}
        if not found:
            chosen = pick(key, loads, spill, among)
            return Route(chosen, "hash" if chosen == rendezvous_among(key, among) else "load")
        order = {i: r for r, i in enumerate(sorted(among, key=lambda i: _rank(key, i), reverse=True))}

        def score(i: int) -> tuple[float, int, int]:
            k, tier = found.get(i, (0, 0))
            return resume_score(k, tier, len(hashes), loads[i]), -loads[i], -order[i]

        best = max(among, key=score)
        if best in found:
            return Route(best, f"resume_{TIERS[found[best][1]]}", found[best][0])
        return Route(best, "load")


def _rank(key: bytes, i: int) -> bytes:
    return hashlib.sha256(key + i.to_bytes(2, "little")).digest()
