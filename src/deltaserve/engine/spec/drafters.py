"""Model-free drafters: tokens proposed from what a request (and its session) already holds.

Each keeps a per-sequence index, extended incrementally with the tokens the sequence gained since
its last proposal (O(new tokens) per step, never a rescan). `propose(seq, k)` returns at most k
tokens; an empty list is a zero-draft step. Both are deterministic: a draft is a point mass,
which the rejection rule of `verify.py` relies on."""

from __future__ import annotations

import weakref
from collections import deque

from ..request.sequence import Sequence


class _Tokens:
    """A sequence's tokens as the index saw them (`grow` appends what is new)."""

    def __init__(self):
        self.ids: list[int] = []

    def grow(self, seq: Sequence) -> list[int]:
        new = seq.token_slice(len(self.ids), seq.num_tokens)
        self.ids.extend(new)
        return new


def _copy_from(ids: list[int], start: int, k: int) -> list[int]:
    """k tokens continuing `ids` as if it repeated from `start` (an overlapping copy: past the end
    the copy reads its own output, so a loop of period len(ids) - start drafts k tokens)."""
    out: list[int] = []
    n = len(ids)
    for i in range(k):
        j = start + i
        out.append(ids[j] if j < n else out[j - n])
    return out


class _NgramIndex(_Tokens):
    """n-gram (tuple) -> where its latest earlier occurrence was continued."""

    def __init__(self, lo: int, hi: int):
        super().__init__()
        self.lo, self.hi = lo, hi
        self.after: dict[tuple[int, ...], int] = {}

    def grow(self, seq: Sequence) -> list[int]:
        """Index the n-grams ending at e - 1, continued at e, for every new position e (a later e
        replaces an earlier one): per n one `dict.update` over zipped slices (a prompt's first index
        in C loops, not one tuple a position and n in Python)."""
        first = len(self.ids)
        new = super().grow(seq)
        ids, end = self.ids, len(self.ids)
        for n in range(self.lo, self.hi + 1):
            e0 = max(first, 1, n)
            if e0 < end:
                keys = zip(*(ids[e0 - n + i : end - n + i] for i in range(n)))
                self.after.update(zip(keys, range(e0, end)))
        return new

    def propose(self, k: int) -> list[int]:
        ids = self.ids
        tail = tuple(ids[-self.hi :])
        for n in range(len(tail), self.lo - 1, -1):
            e = self.after.get(tail[-n:])
            if e is not None:
                return _copy_from(ids, e, k)
        return []


class NgramDrafter:
    """Prompt lookup: the longest suffix of `hi` down to `lo` tokens seen before proposes the tokens
    after its latest earlier occurrence."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self._index: weakref.WeakKeyDictionary[Sequence, _NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = _NgramIndex(self.lo, self.hi)
        index.grow(seq)
        return index.propose(k)

    def finished(self, seq: Sequence) -> None:
        self._index.pop(seq, None)


class SuffixTable:
    """Continuation counts: context (the 1..`depth` tokens before a position) -> {next token: count}."""

    def __init__(self, depth: int):
        self.depth = depth
        self.next: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, ids: list[int], start: int, sign: int = 1) -> None:
        """Count (sign -1: uncount) the continuations at positions [start, len(ids))."""
        for e in range(max(start, 1), len(ids)):
            t = ids[e]
            for d in range(1, min(self.depth, e) + 1):
                ctx = tuple(ids[e - d : e])
                counts = self.next.setdefault(ctx, {})
                counts[t] = counts.get(t, 0) + sign
                if counts[t] <= 0:
                    del counts[t]
                    if not counts:
                        del self.next[ctx]

    def match(self, tail: list[int]) -> tuple[int, dict[int, int] | None]:
        """(depth, counts) of the longest context ending `tail` that was continued before."""
        for d in range(min(self.depth, len(tail)), 0, -1):
            counts = self.next.get(tuple(tail[len(tail) - d :]))
            if counts:
                return d, counts
        return 0, None


class SuffixDrafter:
    """Suffix decoding over the prompt, the request's own output and a session store of the latest
    `keep` finished requests' tokens: each draft token is the most frequent continuation of the
    longest context matched in either (the request's own on ties), while the product of the
    chosen continuations' frequencies stays at least `min_prob`."""

    def __init__(self, depth: int, min_prob: float, keep: int):
        self.depth, self.min_prob, self.keep = depth, min_prob, keep
        self._own: weakref.WeakKeyDictionary[Sequence, tuple[_Tokens, SuffixTable]] = weakref.WeakKeyDictionary()
        self.session = SuffixTable(depth)
        self._kept: deque[list[int]] = deque()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        entry = self._own.get(seq)
        if entry is None:
            entry = self._own[seq] = (_Tokens(), SuffixTable(self.depth))
        tokens, table = entry
        first = len(tokens.ids)
        tokens.grow(seq)
        table.add(tokens.ids, first)  # the new positions; their contexts may reach into old ones
        tail = tokens.ids[-self.depth :]
        out: list[int] = []
        prob = 1.0
        while len(out) < k:
            d, counts = table.match(tail)
            ds, session = self.session.match(tail)
            if ds > d:
                counts = session
            if counts is None:
                break
            token, n = max(counts.items(), key=lambda kv: kv[1])
            prob *= n / sum(counts.values())
            if prob < self.min_prob:
                break
            out.append(token)
            tail = (tail + [token])[-self.depth :]
        return out

    def finished(self, seq: Sequence) -> None:
        """A finished request's tokens join the session store (the oldest leave past `keep`)."""
        entry = self._own.pop(seq, None)
        if entry is None or self.keep == 0:
            return
        ids = entry[0].ids
        self.session.add(ids, 0)
        self._kept.append(ids)
        if len(self._kept) > self.keep:
            self.session.add(self._kept.popleft(), 0, sign=-1)
