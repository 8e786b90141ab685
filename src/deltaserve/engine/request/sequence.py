"""A `Sequence` is one sample being generated; a request with `n > 1` owns n of them.

Invariant: tokens `all_ids[:num_computed]` are in the cache (KDA slot state and MLA pages);
the scheduler feeds `all_ids[num_computed:]` next. Preemption by recompute resets
`num_computed` to 0 and keeps `output_ids`, so the resumed sequence re-prefills prompt plus
outputs and carries on with the same tokens (its generator is not reset).

Image i of `images` owns the prompt's pad positions `[image_starts[i], image_starts[i] + N_i)`
(engine/request/mm_inputs.py); `image_spans` are those ranges with each image's digest, the extra keys of
the sequence's prefix hash chain.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .outputs import Logprob
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .multimodal import ImageInput


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad prompt, length over max_model_len, unknown id)."""


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    detokenizer: object | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    final_delta: str = ""
    cache_salt: str | None = None
    prefix_hashes: list[bytes] = field(default_factory=list)  # memo for CacheManager.lookup
    images: tuple[ImageInput, ...] = ()
    image_starts: tuple[int, ...] = ()
    prefill_only: bool = False  # a prefill instance's: computed, then parked for a handoff, never sampled
    preadmitted: bool = False  # holds cache already (a received handoff): the scheduler skips admission

    @property
    def image_spans(self) -> tuple[tuple[int, int, bytes], ...]:
        return tuple((s, s + im.image.num_tokens, im.digest) for s, im in zip(self.image_starts, self.images))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p : stop - p]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
