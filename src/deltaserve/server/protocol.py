"""Pydantic v2 request schemas shaped like OpenAI's, plus the error body and caps.

Fields are strict (no str -> int coercion, no NaN/inf); caps on `n`, `logprobs` and `stop`
are checked here, before any work. Every string in a request (keys too, at any depth: prompts,
messages, stop strings, tools, schemas) is valid Unicode: JSON's `\\ud800` escapes decode to
lone surrogates, which the tokenizer would silently replace and a UTF-8 response cannot carry
(echo), so such a field is a 400 here. Responses are built as plain dicts in `routes/`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from ..engine.request.sampling_params import MAX_LOGPROBS

MAX_N = 16
MAX_BATCH = 64  # completion prompts per request, and prompts * n
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_BODY_BYTES = 8 * 2**20
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias

Number = Union[StrictInt, StrictFloat]
Stop = Union[StrictStr, list[StrictStr], None]


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | int | None = None
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _bad_text(v: str) -> int | None:
    """Index of the first lone surrogate in `v`, else None."""
    if v.isascii():
        return None
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """`"<path>: lone surrogate U+XXXX ..."` for the first string in `value` (nested dicts and
    lists, keys included) that is not valid Unicode, else None. Iterative (any depth); paths
    are only built once a bad string is known to be there."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if _bad_text(v) is not None:
                break
        elif isinstance(v, dict):
            todo += v
            todo += v.values()
        elif isinstance(v, list):
            todo += v
    else:
        return None
    todo = [(path, value)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str):
            at = _bad_text(v)
            if at is not None:
                where = f"{where}: " if where else ""
                return f"{where}lone surrogate U+{ord(v[at]):04X} is not valid Unicode text"
        elif isinstance(v, dict):
            for k, x in reversed(v.items()):
                todo += [(f"{where}.{k}" if isinstance(k, str) else where, x), (where, k)]
        elif isinstance(v, list):
            todo += [(f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v)))]
    return None


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, v: Any, info: ValidationInfo) -> Any:
        bad = lone_surrogate(v, info.field_name if isinstance(v, (dict, list)) else "")
        if bad is not None:
            raise ValueError(bad)
        return v


class StreamOptions(_Base):
    include_usage: StrictBool = False


class _Sampling(_Base):
    model: StrictStr
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: Optional[Number] = Field(None, ge=0, le=2)
    top_p: Optional[Number] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1)
    min_p: Optional[Number] = Field(None, ge=0, le=1)
    seed: Optional[StrictInt] = Field(None, ge=-(2**63), lt=2**64)
    stop: Stop = None
    stop_token_ids: Optional[list[StrictInt]] = Field(None, max_length=MAX_STOP)
    presence_penalty: Optional[Number] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[Number] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[Number] = Field(None, gt=0, le=10)
    min_tokens: StrictInt = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    logit_bias: Optional[dict[StrictStr, Number]] = Field(None, max_length=MAX_LOGIT_BIAS)
    cache_salt: Optional[StrictStr] = Field(None, min_length=1, max_length=1024)
    prompt_cache_key: Optional[StrictStr] = Field(
        None, max_length=1024
    )  # a session: the DP front keeps it on one replica

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict | None) -> dict[int, float] | None:
        """OpenAI's form: token ids (decimal strings, JSON object keys) -> a bias in [-100, 100]."""
        if v is None:
            return None
        bad = next((k for k in v if not (k.isascii() and k.isdigit() and len(k) <= 10)), None)
        if bad is not None:
            raise ValueError(f"keys must be token ids (non-negative integers), got {bad!r}")
        out = {int(k): float(b) for k, b in v.items()}
        if any(not -100 <= b <= 100 for b in out.values()):
            raise ValueError("biases must lie in [-100, 100]")
        return out

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed")
        if any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop strings must be non-empty and at most {MAX_STOP_LEN} characters")
        return stops

    def sampling_kwargs(self) -> dict:
        """Keyword arguments for `SamplingParams` (OpenAI defaults where a field is absent)."""
        kw: dict[str, Any] = dict(
            n=self.n,
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            logit_bias=self.logit_bias,
        )
        for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = float(v)
        if self.top_k is not None:
            kw["top_k"] = self.top_k
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class JsonSchemaFormat(_Base):
    name: StrictStr = Field(min_length=1, max_length=64)
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[StrictStr] = None
    strict: Optional[StrictBool] = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    response_format: Optional[ResponseFormat] = None


class FunctionName(_Base):
    name: StrictStr = Field(min_length=1)


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: FunctionName


class ChatTemplateKwargs(_Base):
    thinking: Optional[StrictBool] = None
    thinking_effort: Optional[Literal["low", "high", "max"]] = None


class ThinkingConfig(_Base):
    """Moonshot's `thinking` object: `{"type": "enabled"|"disabled", "keep": "all", "effort": ...}`.

    `keep`: only "all" (preserved thinking: every earlier assistant turn's `reasoning_content` is
    rendered in its think element) or absent, which renders the same: the public K3 encoder has
    no mode that drops earlier reasoning, so no other value has a meaning to serve (400)."""

    type: Literal["enabled", "disabled"]
    keep: Optional[Literal["all"]] = None
    effort: Optional[Literal["low", "high", "max"]] = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    response_format: Optional[ResponseFormat] = None
    thinking: Optional[ThinkingConfig] = None  # a bool is read as {"type": "enabled"|"disabled"}
    reasoning_effort: Optional[Literal["low", "high", "max"]] = None
    thinking_effort: Optional[Literal["low", "high", "max"]] = None
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    thinking_token_budget: Optional[StrictInt] = Field(None, ge=0)
    max_reasoning_tokens: Optional[StrictInt] = Field(None, ge=0)  # alias of thinking_token_budget

    @field_validator("thinking", mode="before")
    @classmethod
    def _thinking_bool(cls, v: Any) -> Any:
        """`thinking: true|false` is the object with that type, so a bad object field's error
        names it (`thinking.keep`), not a union member."""
        return {"type": "enabled" if v else "disabled"} if isinstance(v, bool) else v


class TokenizeRequest(_Base):
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[dict[str, Any]]] = Field(None, min_length=1)
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Base):
    model: Optional[StrictStr] = None
    tokens: list[StrictInt] = Field(max_length=1 << 20)
