"""What each sequence gained in a step, for streaming (`EngineCore.step_deltas`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..request.outputs import Logprob


@dataclass
class SeqDelta:
    """What one sequence gained in one step (see `EngineCore.step_deltas`)."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None


def step_deltas(core) -> list[SeqDelta]:
    """`step()`, reported per sequence for streaming: one `SeqDelta` for each sequence that
    got tokens or finished in this step. Its text is `IncrementalDetokenizer.delta()` (on
    finish the flushed `final_delta`), so a sequence's deltas concatenate to its `text`."""
    before = [(s, len(s.output_ids)) for r in core.requests.values() for s in r.seqs if not s.finished]
    core.step()
    out = []
    for s, n in before:
        if len(s.output_ids) == n and not s.finished:
            continue
        if s.detokenizer is None:
            text = ""
        else:
            text = s.final_delta if s.finished else s.detokenizer.delta()
        out.append(
            SeqDelta(
                s.request_id,
                s.index,
                s.output_ids[n:],
                text,
                s.logprobs[n:] if s.logprobs is not None else None,
                s.finish_reason,
                s.stop_reason,
            )
        )
    return out
