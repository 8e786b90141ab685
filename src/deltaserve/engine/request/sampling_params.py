"""Per-request sampling parameters, vLLM's common fields and defaults.

Invariants after `__post_init__` (any violation raises `SamplingParamsError` naming the field
and its allowed range): numeric fields have the right type (a bool is not a number), are
finite and in range; `stop` is a list of non-empty strings; `stop_token_ids` is a list of
non-negative ints; `top_k` is 0 (disabled, `-1` is normalised to 0) or >= 1; float fields
are Python floats; `structured` is None or a `StructuredOutput` (engine/request/structured.py);
`keep_special_token_ids` is a frozenset of non-negative ints: the special tokens that stay in the
text although `skip_special_tokens` is set (the control markers a chat parser reads);
`thinking_token_budget` is None or an int >= 0 and needs a reasoning end: `reasoning_end` (a tuple
of `str` / `Special` pieces starting with a `Special`) or a `structured` output with a prefix
(the same pieces when both are given); see engine/request/reasoning.py; `logit_bias` is None or a dict of
token ids (ints >= 0) to float biases in [-100, 100], added to the logits before anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .structured import Special, StructuredOutput

MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts


class SamplingParamsError(ValueError):
    """An invalid SamplingParams field; the message names the field and the allowed range."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v, lo: int | None = None, hi: int | None = None, rng: str = "") -> int:
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise SamplingParamsError(f"{name} must be an int {rng}, got {v!r}")
    return v


def _float(name: str, v, ok, rng: str) -> float:
    try:
        f = float(v) if _is_int(v) or isinstance(v, float) else math.nan
    except OverflowError:
        f = math.nan
    if not math.isfinite(f) or not ok(f):
        raise SamplingParamsError(f"{name} must be a finite number {rng}, got {v!r}")
    return f


def _bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise SamplingParamsError(f"{name} must be a bool (True or False), got {v!r}")
    return v


@dataclass
class SamplingParams:
    """How to sample one request's continuation; see the module docstring for invariants."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured: StructuredOutput | None = None
    keep_special_token_ids: frozenset[int] | list[int] | None = None
    thinking_token_budget: int | None = None
    reasoning_end: tuple = ()
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        self.n = _int("n", self.n, 1, rng=">= 1")
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1, rng=">= 1 (or None)")
        hi = self.max_tokens
        self.min_tokens = _int(
            "min_tokens", self.min_tokens, 0, hi, rng=">= 0" + (f" and <= max_tokens ({hi})" if hi is not None else "")
        )
        self.temperature = _float("temperature", self.temperature, lambda v: v >= 0, ">= 0")
        self.top_p = _float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        self.top_k = _int("top_k", self.top_k, -1, rng=">= 1, or 0 / -1 (disabled)")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, *_SEED_RANGE, rng=f"in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}] (or None)")
        self.stop = self._stop_list(self.stop)
        self.stop_token_ids = self._id_list(self.stop_token_ids)
        keep = self.keep_special_token_ids
        self.keep_special_token_ids = frozenset(
            self._id_list(list(keep) if isinstance(keep, (set, frozenset)) else keep, "keep_special_token_ids")
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            setattr(self, name, _bool(name, getattr(self, name)))
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, rng=f"in [0, {MAX_LOGPROBS}] (or None)")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _float(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]"))
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingParamsError(
                f"structured must be a StructuredOutput (or None), got {type(self.structured).__name__}"
            )
        self._check_reasoning()
        self.logit_bias = self._bias(self.logit_bias)

    @staticmethod
    def _bias(bias) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict) or not all(_is_int(t) and t >= 0 for t in bias):
            raise SamplingParamsError(f"logit_bias must map token ids (ints >= 0) to biases (or be None), got {bias!r}")
        return {
            t: _float("logit_bias values", b, lambda v: -100 <= v <= 100, "in [-100, 100]") for t, b in bias.items()
        }

    def _check_reasoning(self) -> None:
        end = self.reasoning_end
        if (
            not isinstance(end, (list, tuple))
            or not all(isinstance(p, (str, Special)) for p in end)
            or (end and not isinstance(end[0], Special))
        ):
            raise SamplingParamsError(
                f"reasoning_end must be a tuple of str / Special pieces starting with a Special, got {end!r}"
            )
        self.reasoning_end = tuple(end)
        prefix = self.structured.prefix if self.structured is not None else ()
        if end and prefix and self.reasoning_end != prefix:
            raise SamplingParamsError("reasoning_end must equal the structured output's prefix")
        if self.thinking_token_budget is not None:
            self.thinking_token_budget = _int(
                "thinking_token_budget", self.thinking_token_budget, 0, rng=">= 0 (or None)"
            )
            if not end and not prefix:
                raise SamplingParamsError(
                    "thinking_token_budget needs reasoning_end (or a structured "
                    "output with a prefix): the pieces that close the reasoning"
                )

    @property
    def reasoning_close(self) -> tuple:
        """The pieces that close the reasoning the output starts in (empty: it starts in none)."""
        return self.reasoning_end or (self.structured.prefix if self.structured is not None else ())

    @staticmethod
    def _stop_list(stop) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise SamplingParamsError(
                f"stop must be a non-empty string or a list of non-empty strings (or None), got {stop!r}"
            )
        return list(items)

    @staticmethod
    def _id_list(ids, name: str = "stop_token_ids") -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise SamplingParamsError(f"{name} must be a list of ints >= 0 (or None), got {ids!r}")
        return list(ids)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0 (below SAMPLING_EPS) or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def stop_ids(self, eos_ids) -> set[int]:
        """Ids that end this request: `eos_ids` (unless ignore_eos) plus `stop_token_ids`."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_ids)
        return ids
