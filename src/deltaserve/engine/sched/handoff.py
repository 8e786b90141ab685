"""The engine side of prefill/decode disaggregation (all on the engine thread, between steps).

Prefill instance: `add_request(..., prefill_only=True)` computes the prompt it is given (the
full prompt minus its last token) and parks the sequence with its cache (`EngineCore.parked`);
`parked_regions` names the bytes a decode instance reads, `release_parked` frees them (the
prompt's units and checkpoints stay in this instance's prefix cache, as after any finished turn).

Decode instance: `reserve` admits a sequence for a prompt whose first `len - 1` tokens will
arrive (shared MLA pages where its own prefix cache covers them, fresh pages and a zeroed live
slot otherwise), and for `n > 1` its forks (the pages before the last prompt token shared, a
slot and the rest their own); the transfer writes the rest into the reserved regions of the
first; `fill_forks` copies what the forks do not share; then `add_request(..., received=ids)`
runs them from the last prompt token, or `cancel` frees them all. A reservation holds cache
until one of the two: its owner must call one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cache.handoff import Region, admit_fork, admit_received, copy_fork, handoff_regions
from ..request.sequence import InvalidRequestError


@dataclass(frozen=True)
class Reservation:
    seq_id: int
    start: int  # tokens this instance already holds (shared pages): the transfer starts here
    stop: int  # tokens the transfer fills (the prompt minus its last token)
    slot: int  # the live KDA slot the state lands in (`cache.handoff.kda_regions` in other blocks)
    regions: tuple[Region, ...]  # the MLA rows and the KDA state in one head block
    forks: tuple[int, ...] = ()  # the other samples' sequences (n > 1), filled by `fill_forks`

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return (self.seq_id, *self.forks)


def reserve(
    core, tokens: list[int], cache_salt: str | None = None, spans: tuple = (), n: int = 1
) -> Reservation | None:
    """A reservation for `tokens` (a prompt of at least 2 tokens; `spans` its image spans) and
    `n` samples of it, or None if the pools are short (nothing taken)."""
    seq_id = core._next_seq
    start = admit_received(core.cache, seq_id, tokens, len(tokens) - 1, cache_salt, spans)
    if start is None:
        return None
    forks = tuple(range(seq_id + 1, seq_id + n))
    for i, f in enumerate(forks):
        if not admit_fork(core.cache, seq_id, f):
            for taken in (seq_id, *forks[:i]):
                core.cache.free(taken)
            return None
    core._next_seq += n
    core.reserved.update((seq_id, *forks))
    stop = len(tokens) - 1
    regions = tuple(handoff_regions(core.cache, seq_id, start, stop))
    return Reservation(seq_id, start, stop, core.cache.seqs[seq_id].slot, regions, forks)


def claimable(core, received: int | tuple[int, ...] | None, n: int, prompt_len: int) -> tuple[int, ...] | None:
    """`add_request`'s `received` as one reserved sequence id per sample, each holding a prompt of
    `prompt_len` tokens (None: not a handoff); `InvalidRequestError` otherwise."""
    if received is None:
        return None
    ids = (received,) if isinstance(received, int) else tuple(received)
    held = [getattr(core.cache.seqs.get(s), "prompt_len", -1) for s in ids]
    if len(ids) != n or any(s not in core.reserved for s in ids) or any(p != prompt_len for p in held):
        raise InvalidRequestError(f"no unclaimed handoff reservation {received} for this prompt")
    return ids


def fill_forks(core, res: Reservation) -> None:
    """After the transfer landed in `res.seq_id` (verified): copy it into every fork."""
    for f in res.forks:
        copy_fork(core.cache, res.seq_id, f)


def cancel(core, seq_id: int, forks: tuple[int, ...] = ()) -> None:
    """Free a reservation (and its forks) that will not run (its bytes are discarded); a no-op
    once a request claimed it (the request's own end or abort frees it) or after it was freed."""
    for s in (seq_id, *forks):
        if s in core.reserved:
            core.reserved.discard(s)
            core.cache.free(s)


def parked_regions(core, request_id: str, start: int, blocks: int = 1) -> list[Region]:
    """The regions of a parked prefill from token `start` (a page boundary) to its end, the KDA
    heads in `blocks` blocks (`ValueError` if they do not divide)."""
    seq_id = core.parked[request_id]
    sc = core.cache.seqs[seq_id]
    if start % core.cache.page_size or not 0 <= start <= sc.prompt_len:
        raise ValueError(f"handoff start {start} is not a page boundary within the prompt")
    return handoff_regions(core.cache, seq_id, start, sc.prompt_len, blocks)


def release_parked(core, request_id: str) -> bool:
    """Free a parked prefill's cache (keeping what it added to the prefix cache); False if unknown."""
    seq_id = core.parked.pop(request_id, None)
    if seq_id is None:
        return False
    core.cache.free(seq_id, finished=True)
    return True
