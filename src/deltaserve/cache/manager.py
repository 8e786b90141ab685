"""`CacheManager`: the pools, who owns what, and (when enabled) the hybrid prefix cache.

A prefix hit of length L needs MLA pages covering [0, L) and a KDA checkpoint at exactly L: both
halves or nothing. A hit shares the full pages (L is a multiple of the match unit, itself a
multiple of the page size, so no partial page is ever shared) and copies the checkpoint into the
sequence's own live slot (copy-on-write): live slots are never shared, checkpoint slots are only
written before they are registered.

Admission pins everything its hit uses (the shared pages by reference, the checkpoint by
`PrefixIndex.pin_checkpoint`) before it takes fresh pages, so the eviction that frees those pages
never removes what the hit is about to copy; if the pool cannot hold both, nothing is taken and
the request waits. Restores are fail-closed: every checkpoint carries a `CheckpointTag` (written
when its state is), and a lookup refuses (counts, drops) one whose tag does not match the
request's own hash chain, token count and this manager's producer fingerprint.

A request whose longer prefix a running, older sequence is still prefilling can wait for it
(`inflight_hit`): the scheduler holds it while that sequence's computed frontier is short of the
boundary, which the sequence is made to checkpoint, so the prefix is computed once.

Invariants (`check_integrity`): every page's refcount equals the number of sequence block
tables plus index units listing it; every live slot has one owner; every checkpoint slot is
owned by exactly one index entry or one sequence's pending/turn-end snapshot.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field

from .checkpoint_policy import CheckpointPolicy
from .checkpoint_tag import CheckpointTag, state_fingerprint
from .hashing import common_units, extend_hashes, root_hash
from .kda_pool import KdaStatePool
from .mla_pool import MlaPagePool
from .prefix_index import PrefixIndex
from .slot_journal import SlotJournal
from .tiers import DROP, LowerTier

# the prefix_stats() keys counted by the manager itself
_COUNTED = (
    "queries hits hit_tokens retention_misses retention_miss_tokens checkpoints_stored restore_refused inflight_waits"
).split()


@dataclass
class SeqCache:
    slot: int
    pages: list[int] = field(default_factory=list)
    root: bytes = b""
    prompt_len: int = 0
    hashes: list[bytes] = field(default_factory=list)
    registered: int = 0  # leading units in the index
    wanted: set[int] = field(default_factory=set)  # boundaries to checkpoint
    pending: dict[int, int] = field(default_factory=dict)  # boundary -> slot, written this step
    turn: tuple[int, int] | None = None  # (boundary, slot) of the latest decode-side state
    chain: tuple[bytes, ...] = ()  # unit hashes of its tokens at admission
    received: bool = False  # its prompt arrives by handoff: it never prefills (checkpoints) that span


@dataclass(frozen=True)
class PrefixHit:
    length: int = 0
    k_mla: int = 0
    k_hit: int = 0
    hashes: tuple[bytes, ...] = ()
    root: bytes = b""
    reading: bool = False  # the tier is reading a longer prefix: wait (`inflight_hit`)


class CacheManager:
    def __init__(
        self,
        mla: MlaPagePool,
        kda: KdaStatePool,
        checkpoints: KdaStatePool | None = None,
        policy: CheckpointPolicy | None = None,
        model_id: str = "",
        kernel: str = "torch",
        tier: LowerTier = DROP,
    ):
        """`model_id` and `kernel` (the KDA kernel path computing states) enter the fingerprint
        that tags every checkpoint; `tier` takes what the prefix index evicts (`tiers.py`)."""
        self.mla, self.kda, self.ckpt_pool = mla, kda, checkpoints
        self.page_size = mla.page_size
        self.seqs: dict[int, SeqCache] = {}
        self.policy = policy or CheckpointPolicy()
        if checkpoints is not None and self.policy.unit % self.page_size:
            raise ValueError(f"prefix_match_unit={self.policy.unit} must be a multiple of page_size={self.page_size}")
        self.index = PrefixIndex(mla, checkpoints, tier) if checkpoints is not None else None
        self.tier = tier
        self.model_id = model_id
        self.kernel = kernel
        self.fingerprint = state_fingerprint(model_id, kda.tails, kda.states, kernel)
        self.counters: Counter[str] = Counter()

    def attach_tier(self, tier: LowerTier) -> None:
        """Put `tier` (`tiers.store.TieredStore`) under the device index (write-through, restores)."""
        if self.index is None:
            raise ValueError("cache tiers need the prefix cache (--enable-prefix-caching)")
        self.tier = self.index.tier = tier

    @property
    def prefix_enabled(self) -> bool:
        return self.index is not None

    def lookup(
        self,
        tokens: list[int],
        cache_salt: str | None = None,
        memo: list[bytes] | None = None,
        spans: tuple[tuple[int, int, bytes], ...] = (),
        restore: bool = False,
    ) -> PrefixHit:
        """Longest usable hit (L < len(tokens)). A checkpoint on the path whose tag does not match
        is refused (counted, dropped) and a shorter one is tried. With `restore` (the scheduler's
        admission), a longer prefix held by the lower tier is first installed into the device
        index (`tiers.LowerTier.restore`); otherwise the lookup changes nothing else.
        `memo`, kept by the caller for one sequence (fixed salt and `spans`, tokens only ever
        appended), holds the unit hashes computed so far and is extended in place, so a waiting
        request is not re-hashed every step. `spans`: the per-unit extra keys
        (`hashing.extend_hashes`), the same the sequence later commits with."""
        if self.index is None:
            return PrefixHit()
        u = self.policy.unit
        root = root_hash(self.model_id, cache_salt)
        limit = (len(tokens) - 1) // u
        hashes = extend_hashes(memo if memo is not None else [], root, tokens[: limit * u], u, spans)[:limit]
        k_mla, k_hit = self.index.match(hashes)
        done = self.tier.restore(self, hashes, k_mla, k_hit) if restore else False
        if done:
            k_mla, k_hit = self.index.match(hashes)
        while k_hit and not self._restorable(hashes, k_hit):
            k_mla, k_hit = self.index.match(hashes)
        return PrefixHit(k_hit * u, k_mla, k_hit, tuple(hashes), root, done is None)

    def tag(self, prefix_hash: bytes, num_tokens: int) -> CheckpointTag:
        """The tag a state at `num_tokens` ending the prefix `prefix_hash` gets from this manager."""
        return CheckpointTag(prefix_hash, num_tokens, self.fingerprint)

    def _restorable(self, hashes: list[bytes] | tuple[bytes, ...], k: int) -> bool:
        """Whether the checkpoint at unit boundary k (cached) may be restored for this hash chain;
        if not, it is refused: counted and dropped from the index, never used."""
        h = hashes[k - 1]
        if self.ckpt_pool.tags[self.index.ckpts[h]] == self.tag(h, k * self.policy.unit):
            return True
        self.index.drop_checkpoint(h)
        self.counters["restore_refused"] += 1
        return False

    def _hit_present(self, hit: PrefixHit) -> bool:
        """The hit's units and checkpoint are still cached (a hit is only valid until the next
        cache change; the scheduler looks up right before it admits)."""
        h = hit.hashes[hit.k_hit - 1]
        return h in self.index.ckpts and all(x in self.index.units for x in hit.hashes[: hit.k_hit])

    def _take_pages(self, n: int) -> list[int] | None:
        if n > self.mla.num_free and self.index is not None:
            self.index.evict_pages(n)
        return self.mla.allocate(n) if n <= self.mla.num_free else None

    def admit(self, seq_id: int, num_tokens: int, hit: PrefixHit | None = None, prompt_len: int = 0) -> bool:
        """Give a new sequence a live slot (the hit's checkpoint copied in, else zeros), the hit's
        shared pages and fresh pages up to `num_tokens`; False (nothing taken) if short."""
        if seq_id in self.seqs:
            raise RuntimeError(f"sequence {seq_id} already holds cache")
        hit = hit or PrefixHit()
        if self.kda.num_free == 0:
            return False
        if hit.k_hit and not (self._hit_present(hit) and self._restorable(hit.hashes, hit.k_hit)):
            return False
        ckpt = hit.hashes[hit.k_hit - 1] if hit.k_hit else None
        shared = self.index.pages_of(list(hit.hashes), hit.k_hit) if ckpt else []
        self.mla.incref(shared)
        if ckpt:
            self.index.touch(list(hit.hashes), hit.k_mla)
        with self.index.pinned_checkpoint(ckpt) if ckpt else nullcontext():
            fresh = self._take_pages(self.mla.pages_for(num_tokens) - len(shared))
            if fresh is None:
                self.mla.release(shared)
                return False
            slot = self.kda.allocate()
            if ckpt:
                self._copy(self.ckpt_pool, self.index.ckpts[ckpt], self.kda, slot)
        sc = SeqCache(
            slot, shared + fresh, hit.root, prompt_len, list(hit.hashes[: hit.k_hit]), hit.k_hit, chain=hit.hashes
        )
        self.seqs[seq_id] = sc
        if self.index is not None:
            self._count_lookup(hit)
            sc.wanted = self.policy.boundaries(prompt_len, hit)
        return True

    def inflight_hit(self, hit: PrefixHit, older_than: int) -> int:
        """The hit length (tokens) a request whose lookup gave `hit` gets by waiting for a running
        sequence with id below `older_than` to prefill past it, or 0 if no such sequence adds at
        least one match unit. The boundary lies within the span the two hash chains share and past
        what that sequence has computed: under the junction policy the end of the span, which the
        sequence is made to checkpoint, else the last boundary it checkpoints anyway. Each
        positive answer (one request held one step) counts as an `inflight_wait`. A hit whose
        longer prefix the tier is reading waits for it too (`reading`; counted by the tier)."""
        if hit.reading:
            return hit.length + self.policy.unit
        if self.index is None or not hit.hashes:
            return 0
        u, best, owner = self.policy.unit, 0, None
        for seq_id, sc in self.seqs.items():
            if seq_id >= older_than or sc.received:
                continue
            shared = common_units(sc.chain, hit.hashes) * u
            floor = max(len(sc.hashes) * u, hit.length)
            if shared <= floor:
                continue
            b = shared if self.policy.junction else max((x for x in sc.wanted if floor < x <= shared), default=0)
            if b > best:
                best, owner = b, sc
        if owner is not None:
            owner.wanted.add(best)
            self.counters["inflight_waits"] += 1
        return best

    def _count_lookup(self, hit: PrefixHit) -> None:
        c = self.counters
        c["queries"] += 1
        if hit.k_hit:
            c["hits"] += 1
            c["hit_tokens"] += hit.length
        if hit.k_mla > hit.k_hit:
            c["retention_misses"] += 1
            c["retention_miss_tokens"] += (hit.k_mla - hit.k_hit) * self.policy.unit

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make the sequence's pages cover `num_tokens` tokens; False (nothing taken) if short."""
        sc = self.seqs[seq_id]
        extra = self.mla.pages_for(num_tokens) - len(sc.pages)
        if extra <= 0:
            return True
        fresh = self._take_pages(extra)
        if fresh is None:
            return False
        sc.pages.extend(fresh)
        return True

    def _ckpt_slot(self) -> int | None:
        if self.ckpt_pool.num_free == 0 and not self.index.evict_checkpoint():
            return None
        return self.ckpt_pool.allocate()

    def plan_exports(self, seq_id: int, start: int, n: int) -> tuple[list[int], list[int]]:
        """Interior offsets (relative to `start`, 0 < o < n) of this chunk to snapshot in the
        forward pass, and the checkpoint slots they go to. Chunk-end boundaries are copied from
        the live slot in `commit`."""
        if self.index is None:
            return [], []
        sc = self.seqs[seq_id]
        offsets, slots = [], []
        for b in sorted(x for x in sc.wanted if start < x <= start + n):
            slot = self._ckpt_slot()
            if slot is None:
                break
            sc.pending[b] = slot
            if b < start + n:
                offsets.append(b - start)
                slots.append(slot)
        return offsets, slots

    def commit(
        self, seq_id: int, tokens: list[int], num_computed: int, spans: tuple[tuple[int, int, bytes], ...] = ()
    ) -> None:
        """After a step: snapshot a chunk-end boundary, register completed units and the step's
        checkpoints, and keep the latest decode-side boundary state for the end of the turn.
        `spans` are the sequence's extra keys, as given to `lookup`."""
        if self.index is None:
            return
        sc, u = self.seqs[seq_id], self.policy.unit
        extend_hashes(sc.hashes, sc.root, tokens[:num_computed], u, spans)
        if num_computed in sc.pending:
            self._copy(self.kda, sc.slot, self.ckpt_pool, sc.pending[num_computed])
        elif num_computed % u == 0 and num_computed > sc.prompt_len and self.policy.turn_end:
            self._snapshot_turn(sc, num_computed)
        self._ensure_units(sc, num_computed // u)
        for b, slot in sc.pending.items():
            sc.wanted.discard(b)
            self.ckpt_pool.tags[slot] = self.tag(sc.hashes[b // u - 1], b)
            self._register(sc, b // u, slot)
        sc.pending.clear()

    def _ensure_units(self, sc: SeqCache, upto: int) -> None:
        """Index units [0, upto) of the sequence. Units it registered under another sequence's
        pages may have been evicted since; a present unit implies present ancestors, so walk
        back to the deepest present one and (re-)add the rest with this sequence's own pages."""
        per_unit = self.policy.unit // self.page_size
        k = min(sc.registered, upto)
        while k > 0 and sc.hashes[k - 1] not in self.index.units:
            k -= 1
        for j in range(k, upto):
            self.index.add_unit(
                sc.hashes[j], sc.hashes[j - 1] if j else None, sc.pages[j * per_unit : (j + 1) * per_unit]
            )
        sc.registered = max(sc.registered, upto)

    def _snapshot_turn(self, sc: SeqCache, boundary: int) -> None:
        slot = sc.turn[1] if sc.turn is not None else self._ckpt_slot()
        if slot is None:
            return
        self._copy(self.kda, sc.slot, self.ckpt_pool, slot)
        self.ckpt_pool.tags[slot] = self.tag(sc.hashes[boundary // self.policy.unit - 1], boundary)
        sc.turn = (boundary, slot)

    def _register(self, sc: SeqCache, k: int, slot: int) -> None:
        """Index `slot` at unit boundary `k` of `sc` (written through to the tier), else free it."""
        if self.index.add_checkpoint(sc.hashes[k - 1], slot):
            self.counters["checkpoints_stored"] += 1
            self.tier.stored(self, sc.hashes, k, slot)
        else:
            self.ckpt_pool.release(slot)

    @staticmethod
    def _copy(src: KdaStatePool, s: int, dst: KdaStatePool, d: int) -> None:
        dst.copy_from(src, s, d)

    def record(self, journal: SlotJournal) -> None:
        """Record every slot write this manager makes in `journal` (for other ranks to replay)."""
        for pool in (self.kda, self.ckpt_pool, self.mla):
            if pool is not None:
                pool.journal = journal

    def free(self, seq_id: int, finished: bool = False) -> None:
        """Release a sequence's cache. `finished=True` (a completed turn, not an abort or
        preemption) keeps its end-of-turn state as a checkpoint."""
        sc = self.seqs.pop(seq_id, None)
        if sc is None:
            return
        for slot in sc.pending.values():
            self.ckpt_pool.release(slot)
        if sc.turn is not None:
            boundary, slot = sc.turn
            if finished and boundary // self.policy.unit <= len(sc.hashes):
                self._ensure_units(sc, boundary // self.policy.unit)
                self._register(sc, boundary // self.policy.unit, slot)
            else:
                self.ckpt_pool.release(slot)
        self.mla.release(sc.pages)
        self.kda.release(sc.slot)

    def reset_prefix_cache(self) -> bool:
        """Evict every cached unit and checkpoint that no running sequence shares; True if the
        index is empty afterwards (as vLLM's `reset_prefix_cache`)."""
        if self.index is None:
            return True
        while self.index.evict_checkpoint():
            pass
        self.index.evict_unshared()
        return not self.index.units and not self.index.ckpts

    def check_integrity(self) -> None:
        refs: dict[int, int] = self.index.page_refs() if self.index is not None else {}
        slots: dict[int, int] = {}
        ckpt_owners: dict[int, int] = {}
        for sc in self.seqs.values():
            for p in sc.pages:
                refs[p] = refs.get(p, 0) + 1
            slots[sc.slot] = slots.get(sc.slot, 0) + 1
            owned = list(sc.pending.values()) + ([sc.turn[1]] if sc.turn is not None else [])
            for s in owned:
                ckpt_owners[s] = ckpt_owners.get(s, 0) + 1
        self.mla.check_integrity(refs)
        self.kda.check_integrity(slots)
        if self.index is not None:
            self.index.check_integrity()
            for s in self.index.ckpts.values():
                ckpt_owners[s] = ckpt_owners.get(s, 0) + 1
            self.ckpt_pool.check_integrity(ckpt_owners)

    def usage(self) -> dict[str, int]:
        return {
            "mla_pages_total": self.mla.num_pages,
            "mla_pages_used": self.mla.num_used,
            "kda_slots_total": self.kda.num_slots,
            "kda_slots_used": self.kda.num_used,
            "page_size": self.page_size,
        }

    def prefix_stats(self) -> dict[str, int]:
        if self.index is None:
            return {}
        out = {k: self.counters[k] for k in _COUNTED}
        out["checkpoints_evicted"] = self.index.evicted_checkpoints
        out["units_evicted"] = self.index.evicted_units
        out["cached_units"] = len(self.index.units)
        out["cached_pages"] = len(self.index.page_refs())
        out["checkpoints"] = len(self.index.ckpts)
        out["checkpoint_slots_total"] = self.ckpt_pool.num_slots
        out["checkpoint_slots_used"] = self.ckpt_pool.num_used
        if hasattr(self.tier, "stats"):
            out["tiers"] = self.tier.stats()
        return out
