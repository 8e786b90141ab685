"""The engine side of prefill/decode disaggregation (all on the engine thread, between steps).

Prefill instance: `add_request(..., prefill_only=True)` computes the prompt it is given (the
full prompt minus its last token) and parks the sequence with its cache (`EngineCore.parked`);
`parked_regions` names the bytes a decode instance reads, `release_parked` frees them (the
prompt's units and checkpoints stay in this instance's prefix cache, as after any finished turn).

Decode instance: `reserve` admits a sequence for a prompt whose first `len - 1` tokens will
arrive (shared MLA pages where its own prefix cache covers them, fresh pages and a zeroed live
slot otherwise); the transfer writes the rest into the reserved regions; then
`add_request(..., received=seq_id)` runs it from the last prompt token, or `cancel` frees it.
A reservation holds cache until one of the two: its owner must call one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...cache.handoff import Region, admit_received, handoff_regions


@dataclass(frozen=True)
class Reservation:
    seq_id: int
    start: int  # tokens this instance already holds (shared pages): the transfer starts here
    stop: int  # tokens the transfer fills (the prompt minus its last token)
    regions: tuple[Region, ...]


def reserve(core, tokens: list[int], cache_salt: str | None = None) -> Reservation | None:
    """A reservation for `tokens` (a prompt of at least 2 tokens), or None if the pools are short."""
    seq_id = core._next_seq
    start = admit_received(core.cache, seq_id, tokens, len(tokens) - 1, cache_salt)
    if start is None:
        return None
    core._next_seq += 1
    core.reserved.add(seq_id)
    stop = len(tokens) - 1
    return Reservation(seq_id, start, stop, tuple(handoff_regions(core.cache, seq_id, start, stop)))


def cancel(core, seq_id: int) -> None:
    """Free a reservation that will not run (its bytes are discarded); a no-op once a request
    claimed it (the request's own end or abort frees it) or after it was freed."""
    if seq_id in core.reserved:
        core.reserved.discard(seq_id)
        core.cache.free(seq_id)


def parked_regions(core, request_id: str, start: int) -> list[Region]:
    """The regions of a parked prefill from token `start` (a page boundary) to its end."""
    seq_id = core.parked[request_id]
    sc = core.cache.seqs[seq_id]
    if start % core.cache.page_size or not 0 <= start <= sc.prompt_len:
        raise ValueError(f"handoff start {start} is not a page boundary within the prompt")
    return handoff_regions(core.cache, seq_id, start, sc.prompt_len)


def release_parked(core, request_id: str) -> bool:
    """Free a parked prefill's cache (keeping what it added to the prefix cache); False if unknown."""
    seq_id = core.parked.pop(request_id, None)
    if seq_id is None:
        return False
    core.cache.free(seq_id, finished=True)
    return True
