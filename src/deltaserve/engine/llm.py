"""Offline API shaped like vLLM's: `LLM(model_dir, ...).generate(prompts, params)`."""
from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cache import CacheManager, build_pools, size_layout
from ..cache.checkpoint_policy import CheckpointPolicy
from ..model import load_model, resolve_dtype
from ..model.tokenizer import Tokenizer
from ..kernels.cpu import native
from .core import EngineCore
from .outputs import RequestOutput
from .reasoning import DEFAULT_STRUCTURED_THINKING_BUDGET
from .sampling_params import SamplingParams
from .sequence import InvalidRequestError

log = logging.getLogger(__name__)


class LLM:
    """Loads a checkpoint, sizes the caches and runs requests to completion.

    `kv_cache_memory` is bytes (int) or a fraction of physical RAM (float), honoured as given;
    by default (None) the pools get what `max_num_seqs` sequences of `max_model_len` tokens can
    use, at most 10 % of RAM (`cache.budget.size_layout`). `max_model_len` defaults to the
    config's `max_position_embeddings`. In bfloat16 the native CPU kernels are built and loaded
    here, so no request pays for the compile. With `skip_tokenizer_init=True` no
    tokenizer is loaded: prompts must be token ids and outputs carry no text.
    `enable_prefix_caching` turns on the hybrid prefix cache (`cache.manager`): hits at multiples
    of `prefix_match_unit` tokens (a multiple of `page_size`), KDA checkpoints kept per
    `kda_checkpoint_policy` ("default" or a comma list of prompt-end, junction, turn-end; plus
    every `kda_checkpoint_interval` tokens) in `checkpoint_fraction` of the budget.
    `moe_weights` ("auto" | "packed" | "dequantized") says whether MXFP4 routed experts stay
    packed ("auto": packed in bf16, dequantized otherwise). `structured_thinking_budget` is the
    reasoning budget of structured requests that start after reasoning and set none (None:
    unlimited; engine/reasoning.py).
    """

    def __init__(self, model: str | Path, dtype: torch.dtype | str = "bfloat16", *, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 2048, page_size: int = 16,
                 kv_cache_memory: int | float | None = None, max_model_len: int | None = None,
                 kv_state_dtype: torch.dtype | str = "float32", skip_tokenizer_init: bool = False,
                 seed: int = 0, device: str = "cpu", num_threads: int | None = None, progress: bool = True,
                 enable_prefix_caching: bool = False, prefix_match_unit: int = 64,
                 kda_checkpoint_policy: str = "default", kda_checkpoint_interval: int | None = None,
                 checkpoint_fraction: float = 0.25, moe_weights: str = "auto",
                 structured_thinking_budget: int | None = DEFAULT_STRUCTURED_THINKING_BUDGET):
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        dtype = resolve_dtype(dtype)
        self.model = load_model(model, dtype=dtype, device=device, progress=progress, moe_weights=moe_weights)
        # the native paths run on bf16 activations only; built/loaded here, never on a request
        kernels = native(device) if dtype == torch.bfloat16 else None
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(model)
        cfg = self.model.config
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        policy = CheckpointPolicy.parse(kda_checkpoint_policy, prefix_match_unit, kda_checkpoint_interval)
        layout = size_layout(cfg, kv_cache_memory, max_num_seqs, self.max_model_len, page_size, dtype,
                             resolve_dtype(kv_state_dtype),
                             checkpoint_fraction if enable_prefix_caching else 0.0)
        self.layout = layout
        model_id = f"{Path(model).resolve()}:{dtype}"
        kernel = "cpu-native" if kernels is not None else "torch"
        self.cache = CacheManager(*build_pools(cfg, layout, device), policy=policy, model_id=model_id,
                                  kernel=kernel)
        self.engine = EngineCore(self.model, self.tokenizer, self.cache, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=self.max_model_len, seed=seed,
                                 structured_thinking_budget=structured_thinking_budget)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def _prompt_ids(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int], str | None]:
        """A prompt is text, token ids, or (as in vLLM) a dict with `prompt` or
        `prompt_token_ids` and an optional `cache_salt` (requests with different salts never
        share cached prefixes)."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            salt = prompt.get("cache_salt")
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt) or \
                    not (salt is None or isinstance(salt, str)):
                raise InvalidRequestError("a dict prompt holds exactly one of 'prompt' / 'prompt_token_ids' "
                                          "and optionally a string 'cache_salt'")
            text, ids = self._prompt_ids(prompt.get("prompt", prompt.get("prompt_token_ids")))[:2]
            return text, ids, salt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            return prompt, self.tokenizer.encode(prompt, allow_special=True), None
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt), None
        raise InvalidRequestError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompts: str | list[str] | list[list[int]] | list[dict],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
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
