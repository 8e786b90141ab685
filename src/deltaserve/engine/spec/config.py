"""`SpecConfig`: the `--speculative-config` JSON (vLLM's shape), parsed and checked.

`{"method": "ngram" | "suffix" | "draft_model", "num_speculative_tokens": k, ...}` (draft_model also
takes `"model": <checkpoint directory>`); unknown keys, wrong types and
values out of range raise `ValueError` naming them, before any model is loaded where the caller
checks early (`EngineConfig` parses the JSON, `build_engine` this)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpecConfig:
    """`num_speculative_tokens`: the most drafts per sequence and step. ngram (prompt lookup):
    the longest of the last `prompt_lookup_max` .. `prompt_lookup_min` tokens that occurred
    before in the prompt or output proposes what followed its latest occurrence. suffix:
    continuation counts of every context of up to `suffix_max_depth` tokens over the prompt, the
    request's output and the `suffix_cache_requests` latest finished requests (a session's
    earlier turns); a draft stops when its running probability falls under `suffix_min_prob`.
    draft_model: a small model of our family at `model` (a checkpoint directory with the target's
    vocabulary and tokenizer) drafts greedily (spec/draft_model.py).
    `adaptive`: each request's k follows its running acceptance (0 turns drafting off for it
    until a probe `probe_interval` decode steps later, backing off while probes fail; a model-free
    method's probes cost an index lookup: it probes from every decode step on, backing off to
    every 8th), weighing
    costs in decode steps (spec/adaptive.py): `draft_cost` of verifying one draft token (a draft
    model adds its own forward's), `step_cost` of a drafted step's fixed work, `rollback_cost` of
    undoing rejected drafts. The defaults are the native CPU path's, measured on the small
    default model (docs/performance.md)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_max_depth: int = 8
    suffix_min_prob: float = 0.1
    suffix_cache_requests: int = 64
    adaptive: bool = True
    draft_cost: float = 0.2
    step_cost: float = 0.45
    rollback_cost: float = 0.35
    probe_interval: int = 16

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "suffix_max_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative {name} must be a positive int, got {v!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        if not 0.0 <= self.suffix_min_prob <= 1.0 or not 0.0 <= self.draft_cost <= 1.0:
            raise ValueError("suffix_min_prob and draft_cost must lie in [0, 1]")
        for name in ("step_cost", "rollback_cost"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 10.0:
                raise ValueError(f"speculative {name} must be a number in [0, 10], got {v!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('speculative "model" (a checkpoint directory) is required by, and only by, draft_model')
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative model must be a checkpoint directory path, got {self.model!r}")
        if self.suffix_cache_requests < 0 or self.probe_interval < 1:
            raise ValueError("suffix_cache_requests must be >= 0 and probe_interval >= 1")

    @classmethod
    def parse(cls, value: str | dict | None) -> SpecConfig | None:
        """The config of a JSON object (text) or dict; None for None / empty."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {unknown} (known: {sorted(names)})")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing:
            raise ValueError(f"speculative config needs {missing}")
        return cls(**value)
