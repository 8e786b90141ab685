"""Offline API shaped like vLLM's: `LLM(model_dir, ...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..model.tokenizer import Tokenizer
from .builder import build_engine
from .config import EngineConfig
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .sequence import InvalidRequestError

log = logging.getLogger(__name__)


class LLM:
    """Loads a checkpoint, sizes the caches and runs requests to completion.

    `LLM(model, dtype, **kwargs)` takes the fields of `EngineConfig` (engine/config.py documents
    them and their defaults) as keyword arguments; `LLM.from_config(config)` takes the config.
    Both start the engine with `build_engine` (engine/builder.py): in bfloat16 the native CPU
    kernels are built and loaded there, so no request pays for the compile. With
    `tensor_parallel_size > 1` it also starts the worker processes; `shutdown()` (or leaving a
    `with LLM(...)` block) stops them. With
    `skip_tokenizer_init=True` no tokenizer is loaded: prompts must be token ids and outputs
    carry no text.
    """

    def __init__(self, model: str | Path, dtype: torch.dtype | str = "bfloat16", **kwargs):
        self._start(EngineConfig(model=model, dtype=dtype, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        self._parts = parts
        self.config = config
        self.model, self.tokenizer, self.layout = parts.model, parts.tokenizer, parts.layout
        self.cache, self.engine, self.max_model_len = parts.cache, parts.core, parts.max_model_len
        self._ids = itertools.count()

    @property
    def rank_memory(self) -> list[dict[str, int]] | None:
        """Every rank's weight bytes and RSS before / at its peak during load (one entry per rank)."""
        return self._parts.rank_memory

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (idempotent; no-op for one process)."""
        self._parts.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def _prompt_ids(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int], str | None]:
        """A prompt is text, token ids, or (as in vLLM) a dict with `prompt` or
        `prompt_token_ids` and an optional `cache_salt` (requests with different salts never
        share cached prefixes)."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            salt = prompt.get("cache_salt")
            if (
                unknown
                or ("prompt" in prompt) == ("prompt_token_ids" in prompt)
                or not (salt is None or isinstance(salt, str))
            ):
                raise InvalidRequestError(
                    "a dict prompt holds exactly one of 'prompt' / 'prompt_token_ids' "
                    "and optionally a string 'cache_salt'"
                )
            text, ids = self._prompt_ids(prompt.get("prompt", prompt.get("prompt_token_ids")))[:2]
            return text, ids, salt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            return prompt, self.tokenizer.encode(prompt, allow_special=True), None
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt), None
        raise InvalidRequestError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. Every request is validated before any is queued; if the run
        is interrupted, the unfinished requests of this call are aborted (cache freed)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        staged = []
        for prompt, p in zip(prompts, params):
            text, ids, salt = self._prompt_ids(prompt)
            rid = str(next(self._ids))
            self.engine.validate(rid, ids, p)
            staged.append((rid, ids, p, text, salt))
        results: dict[str, RequestOutput] = {}
        try:
            for rid, ids, p, text, salt in staged:
                self.engine.add_request(rid, ids, p, prompt=text, cache_salt=salt)
            with tqdm(total=len(staged), disable=not use_tqdm, desc="generate") as bar:
                while len(results) < len(staged):
                    if not self.engine.scheduler.has_work():
                        raise RuntimeError("engine idle with unfinished requests")
                    for out in self.engine.step():
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            for rid, *_ in staged:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[rid] for rid, *_ in staged]

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no running request shares; True if none is left."""
        return self.cache.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def pool_snapshot(self) -> dict[str, torch.Tensor]:
        """The pools of every rank gathered in the one-process layout (see engine/pool_snapshot.py)."""
        return self.engine.runner.pool_snapshot()
