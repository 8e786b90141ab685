"""Structured outputs: grammar-constrained decoding with llguidance.

`StructuredOutput` (a frozen, typed value on `SamplingParams.structured`) says what the output
must match: a JSON schema (`{"type": "object"}` is OpenAI's `json_object`) and, optionally, a
free `prefix`: text with no control tokens that must end with the `prefix` marker pieces
(e.g. K3's think-close + response-open) before the JSON starts, so a thinking model reasons
freely and only its answer is constrained (vLLM's "structured output after reasoning end").

`GrammarCompiler(tokenizer, vocab_size, eos_ids)` compiles a `StructuredOutput` into a
per-sequence `GrammarState`; `apply_bitmask` turns the states' packed masks into a `[R, V]`
boolean tensor in one vectorized op (no Python loop over the vocabulary).

Invariants:
- Control (special) tokens are never allowed inside constrained text; the only special tokens
  a grammar admits are the `prefix` markers it names and, once the JSON is complete, the
  end-of-sequence ids `eos_ids` (nothing else: a complete grammar allows only EOS, and
  `GrammarState.advance` reports it done so the engine stops without sampling that EOS).
- Object keys are generated in the schema's declared `properties` order (as vLLM / OpenAI).
- JSON is generated compactly (no free whitespace between tokens), so a grammar cannot be kept
  alive by whitespace alone.
- Ids at or past the tokenizer's vocabulary (model padding rows) are never allowed.
- The free text before a `prefix` is any run of non-control tokens (a token-level rule, so a
  character split across byte tokens never blocks the first marker: a reasoning budget can
  always close the think element). A raw grammar's `%text%` is the same but never spells `<|`,
  within a token or across two (also token-level, for the same reason).
- Decided at request time, before anything is queued (`StructuredOutputError`): a `pattern`
  whose counted repetitions expand it past `MAX_PATTERN_SIZE` items and its own length (in
  `StructuredOutput.json`), a schema over
  `MAX_SCHEMA_BYTES`, one llguidance cannot compile within `GRAMMAR_LIMITS`, one that admits no
  finite JSON value (engine/request/schema_check.py), one whose grammar allows no first token.
  `GrammarCompiler.compile` is thread-safe and caches compiled grammars (LRU), so a server
  compiles off its event loop and the engine thread then only copies the cached matcher.
- A grammar that rejects a token or errors while decoding reports `GrammarState.failure`; the
  engine then finishes the sequence with "error", never "stop".
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...kernels.transfer import tensor_on
from .schema_check import no_finite_instance, pattern_size, patterns, rebase_refs

ANY_JSON_OBJECT: dict = {"type": "object"}
MAX_SCHEMA_BYTES = 128 * 1024  # compact JSON text; bounds compile time (~0.5 s at the cap)
# expanded size of a `pattern` (schema_check.pattern_size) beyond its own length (long literal
# patterns are bounded by MAX_SCHEMA_BYTES and the lexer fuel): llguidance expands counted repeats
# lazily, as decoding enters them (`^a{10000}$` ~0.1 s, `^(ab){5000}$` ~1.3 s of one engine step;
# `^a{3000000}$` fails there with "too many expressions constructed")
MAX_PATTERN_SIZE = 4096
# llguidance's resource limits (LLParserLimits): grammar symbols, lexer fuel at build time and
# per mask step (~14k fuel/ms), lexer states (~1-2 kB each)
GRAMMAR_LIMITS = {
    "max_grammar_size": 100_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "max_lexer_states": 100_000,
}
_SHIFTS = torch.arange(32, dtype=torch.int32)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_CACHE_SIZE = 64


class StructuredOutputError(ValueError):
    """A constraint that cannot be built or compiled (bad JSON schema, unknown control token);
    `EngineCore` reports it as an `InvalidRequestError`."""


@dataclass(frozen=True)
class Special:
    """A control token, named as the tokenizer names it (e.g. `<|close|>`)."""

    name: str


@dataclass(frozen=True)
class StructuredOutput:
    """Output = [free text (no control tokens) + `prefix` pieces] + JSON matching `json_schema`.

    `json_schema` is stored as compact JSON text (key order kept) so the value is hashable and
    immutable;
    `prefix` is a tuple of `str` (literal text) and `Special` pieces. An empty prefix means the
    JSON starts at the first generated token.
    """

    json_schema: str
    prefix: tuple = ()
    grammar: str = ""  # a whole llguidance Lark grammar instead of the JSON (`raw`)

    @classmethod
    def raw(cls, grammar: str) -> "StructuredOutput":
        """A whole llguidance Lark grammar (e.g. the K3 channel guard); `%free%` in it stands for
        the rule body "any run of non-control tokens", `%text%` for the same never spelling `<|`."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise StructuredOutputError("a raw grammar must be non-empty Lark text")
        return cls("", (), grammar)

    @classmethod
    def json(cls, schema: dict | None = None, prefix: Sequence = ()) -> "StructuredOutput":
        """Any JSON object when `schema` is None (OpenAI `json_object`), else `schema`."""
        schema = ANY_JSON_OBJECT if schema is None else schema
        if not isinstance(schema, dict):
            raise StructuredOutputError("a JSON schema must be a JSON object")
        for pattern in patterns(schema):
            if (size := pattern_size(pattern)) > max(MAX_PATTERN_SIZE, len(pattern)):
                raise StructuredOutputError(
                    f"the pattern {_short(pattern, 60)!r} is too large for the grammar engine (its counted "
                    f"repetitions expand to about {size} items; at most {MAX_PATTERN_SIZE})"
                )
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise StructuredOutputError(f"the JSON schema is not serialisable JSON: {e}") from None
        return cls(text, tuple(prefix))

    def __post_init__(self):
        if not isinstance(self.json_schema, str):
            raise StructuredOutputError("json_schema must be JSON text (use StructuredOutput.json)")
        if not all(isinstance(p, (str, Special)) for p in self.prefix):
            raise StructuredOutputError("prefix pieces must be str or Special")

    def lark(self, free: str = "/(.|\\n)*/", text: str = "/([^<]|<[^|])*<?/") -> str:
        """The llguidance Lark grammar (JSON options forced compact, see module invariants);
        `free` / `text` are the bodies of `%free%` / `%text%` (`GrammarCompiler` passes
        token-level rules: non-control tokens, and those never spelling `<|`)."""
        if self.grammar:
            return self.grammar.replace("%free%", free).replace("%text%", text)
        schema = json.loads(self.json_schema)
        schema.pop("x-guidance", None)
        schema["x-guidance"] = _JSON_OPTIONS
        body = "value: %json " + json.dumps(schema, separators=(",", ":"))
        if not self.prefix:
            return "start: value\n" + body + "\n"
        marks = " ".join(p.name if isinstance(p, Special) else json.dumps(p) for p in self.prefix)
        return f"start: free {marks} value\nfree: {free}\n{body}\n"


def tool_call_schema(tools: list[dict], name: str | None = None) -> dict:
    """vLLM's forced-tool-choice schemas: with `name`, that function's parameters (an object);
    without, a non-empty array of `{"name": one declared function, "parameters": its schema}`,
    each schema's local `$ref`s rebased to where it sits in the array schema (`rebase_refs`), so
    its `$defs` / `definitions` (and `#` itself) resolve as in the tool's own document."""
    fns = [t.get("function", t) for t in tools]
    params = {f["name"]: f.get("parameters") or {"type": "object"} for f in fns}
    if name is not None:
        if name not in params:
            raise StructuredOutputError(f"tool_choice names {name!r}, which is not among the tools")
        return params[name]
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": n},
                "parameters": rebase_refs(p, f"#/items/anyOf/{i}/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, (n, p) in enumerate(params.items())
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}


class GrammarState:
    """One sequence's position in its grammar (a wrapped `llguidance.LLMatcher`)."""

    def __init__(self, matcher):
        self._m = matcher

    def bitmask(self) -> torch.Tensor:
        """Allowed next tokens as packed int32 words (bit `i % 32` of word `i // 32`)."""
        return torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.int32)

    def advance(self, token: int) -> bool:
        """Consume `token`; True when the grammar takes no more tokens (it ended or failed)."""
        ok = self._m.consume_token(int(token))
        return not ok or self._m.is_stopped() or self._m.is_error()

    @property
    def failure(self) -> str | None:
        """Why the grammar cannot end well (it rejected a token, hit a limit, or stopped short of
        an accepting state); None while it is fine or complete."""
        if self._m.is_error():
            return "structured output failed: " + _short(self._m.get_error().splitlines()[0], 200)
        if self._m.is_stopped() and not self._m.is_accepting():
            return "structured output failed: the grammar reached a dead end"
        return None

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    def copy(self) -> "GrammarState":
        return GrammarState(self._m.deep_copy())


class GrammarCompiler:
    """Compiles `StructuredOutput`s against one tokenizer. Building the llguidance tokenizer is
    the expensive part (about a second for a 160k vocabulary); do it once per engine."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], limits: dict | None = None):
        import llguidance
        from llguidance.tiktoken import lltokenizer_from_encoding

        self._llg = llguidance
        self.vocab_size = vocab_size
        eos = sorted(e for e in eos_ids if 0 <= e < vocab_size)
        if not eos:
            raise StructuredOutputError("structured outputs need an end-of-sequence token id")
        self._tok = lltokenizer_from_encoding(tokenizer.encoding, n_vocab=vocab_size, eos_token=eos)
        self._specials = set(tokenizer.special_tokens)
        self._free = _token_ranges(len(tokenizer), set(tokenizer.special_ids))
        self._text = _markerless_text(tokenizer)
        self._limits = llguidance.LLParserLimits(**{**GRAMMAR_LIMITS, **(limits or {})})
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutput) -> GrammarState:
        """A fresh state for `so` (thread-safe; see the module invariants for what is refused)."""
        if not isinstance(so, StructuredOutput):
            raise StructuredOutputError(f"structured must be a StructuredOutput, got {type(so).__name__}")
        with self._lock:
            matcher = self._cache.get(so)
            if matcher is not None:
                self._cache.move_to_end(so)
        if matcher is None:
            matcher = self._build(so)
            with self._lock:
                self._cache[so] = matcher
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return GrammarState(matcher.deep_copy())

    def _build(self, so: StructuredOutput):
        unknown = [p.name for p in so.prefix if isinstance(p, Special) and p.name not in self._specials]
        if unknown:
            raise StructuredOutputError(f"the tokenizer has no control tokens {unknown}")
        if so.grammar:
            return self._matcher(so)
        size = len(so.json_schema.encode())
        if size > MAX_SCHEMA_BYTES:
            raise StructuredOutputError(
                f"the JSON schema is too large ({size} bytes as compact JSON; at most {MAX_SCHEMA_BYTES})"
            )
        if no_finite_instance(json.loads(so.json_schema)):
            raise StructuredOutputError(
                "the JSON schema admits no finite JSON value (a required "
                "property or array item recurses into itself without end)"
            )
        return self._matcher(so)

    def _matcher(self, so: StructuredOutput):
        what = "grammar" if so.grammar else "JSON schema"
        try:
            grammar = self._llg.LLMatcher.grammar_from_lark(so.lark(self._free, self._text))
            matcher = self._llg.LLMatcher(self._tok, grammar, log_level=0, limits=self._limits)
        except (ValueError, RuntimeError) as e:
            raise StructuredOutputError(f"invalid {what}: {_short(str(e))}") from None
        if not matcher.is_error():
            first = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            if not matcher.is_error() and not bool(first.any()):
                kind = "output" if so.grammar else "JSON value"
                raise StructuredOutputError(f"the {what} admits no {kind} (the grammar allows no first token)")
        if matcher.is_error():
            raise StructuredOutputError(f"invalid {what}: {_short(matcher.get_error())}")
        return matcher


def _token_set(ids: Sequence[int]) -> str:
    """The ids (sorted) as one llguidance token class (`<[0-9,12-20]>`)."""
    spans, start = [], None
    for k, i in enumerate(ids):
        if start is None:
            start = i
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            spans.append(f"{start}-{i}" if i > start else str(start))
            start = None
    return "<[" + ",".join(spans) + "]>"


def _markerless_text(tokenizer) -> str:
    """Any run of non-control tokens whose bytes never spell `<|`: no token holding it, and after
    a token ending in `<` none starting with `|`. With a = tokens not ending in `<`, b = those
    ending in `<`, and n0 / n1 the ones of a / b not starting with `|`: `(a | b n1* n0)* (b n1*)?`."""
    special = set(tokenizer.special_ids)
    cls: dict[tuple[bool, bool], list[int]] = {(e, p): [] for e in (False, True) for p in (False, True)}
    for i in range(len(tokenizer)):
        raw = tokenizer.token_bytes(i)
        if i not in special and raw and b"<|" not in raw:
            cls[(raw.endswith(b"<"), raw.startswith(b"|"))].append(i)
    a, b = sorted(cls[(False, False)] + cls[(False, True)]), sorted(cls[(True, False)] + cls[(True, True)])
    n0, n1 = cls[(False, False)], cls[(True, False)]
    if not b:
        return f"{_token_set(a)}*"
    tail = f"{_token_set(b)} {_token_set(n1)}*" if n1 else _token_set(b)
    steps = [_token_set(a)] + ([f"{tail} {_token_set(n0)}"] if n0 else [])
    return f"({' | '.join(steps)})* ({tail})?"


def _token_ranges(n: int, excluded: set[int]) -> str:
    """Any run of the ids in [0, n) not in `excluded`, in llguidance syntax (`<[0-9,12-20]>*`)."""
    spans, start = [], None
    for i in range(n + 1):
        inside = i < n and i not in excluded
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            spans.append(f"{start}-{i - 1}" if i - 1 > start else str(start))
            start = None
    return "<[" + ",".join(spans) + "]>*"


def _short(msg: str, limit: int = 300) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[:limit] + "..."


def apply_bitmask(
    x: torch.Tensor, rows: Sequence[int], masks: Sequence[torch.Tensor], fallback: torch.Tensor | None = None
) -> None:
    """In place: `x[rows[j], t] = -inf` for every token `t` that `masks[j]` disallows.

    A row that has no finite logit left afterwards (e.g. a min_tokens ban removed the EOS the
    grammar requires) is refilled from `fallback[j]` (`[len(rows), V]`, the unbanned logits)
    under the grammar mask alone, so the sampled token is always one the grammar accepts.
    """
    if not rows:
        return
    vocab = x.shape[1]
    packed = torch.stack(list(masks)).to(x.device, non_blocking=True)
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(x.device, non_blocking=True)) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    idx = tensor_on(list(rows), x.device)
    sub = x.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    if fallback is not None:  # no test on the host: the refill is chosen row by row on the device
        dead = torch.isneginf(sub).all(dim=-1, keepdim=True)
        refill = fallback.to(sub.device, sub.dtype).masked_fill(~allowed, float("-inf"))
        sub = torch.where(dead, refill, sub)
    x.index_copy_(0, idx, sub)
