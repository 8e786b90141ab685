"""`check_request`: every refusal `EngineCore.add_request` makes, raised before anything is queued."""

from __future__ import annotations

from .mm_inputs import MmPrompt
from .multimodal import ImageInput
from .sampling_params import SamplingParams
from .sequence import InvalidRequestError


def check_request(
    core,
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    images: list[ImageInput] | None,
) -> MmPrompt | None:
    """Raise `InvalidRequestError` for a request the `EngineCore` refuses; returns its images matched to
    the prompt (None without images)."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if request_id in core.requests or request_id in core.parked:
        raise InvalidRequestError(f"request id {request_id!r} is already in use")
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    vocab = core.model.config.vocab_size
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab})")
    if len(prompt_ids) > core.max_model_len:
        n, limit = len(prompt_ids), core.max_model_len
        raise InvalidRequestError(f"prompt of {n} tokens is longer than max_model_len={limit}")
    if params.stop and core.tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer (skip_tokenizer_init=True)")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"stop_token_ids outside [0, {vocab}): {bad}")
    bad = sorted(t for t in params.logit_bias or () if t >= vocab)
    if bad:
        raise InvalidRequestError(f"logit_bias token ids outside [0, {vocab}): {bad[:8]}")
    if params.structured is not None and core.tokenizer is None:
        raise InvalidRequestError("structured outputs need a tokenizer (skip_tokenizer_init=True)")
    return core.image_prompts.prepare(prompt_ids, images) if images else None
