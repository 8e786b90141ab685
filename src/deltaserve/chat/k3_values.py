"""Value rendering for K3 XTML (the public reference encoder's rules, learnt as facts):

- `deep_sort`: dict keys sorted recursively (tool declarations, response schemas).
- `compact_json`: `,` / `:` separators, non-ASCII kept (tool-declare and schema bodies).
- `py_json`: Python's default `json.dumps` spacing (`, ` / `: `), non-ASCII kept: the body of a
  non-string tool-call argument given as an object.
- `call_arguments(arguments)`: `("args", [(key, type, text)])` or `("json", raw)`. An object
  renders value by value (`py_json`); a JSON string is parsed one level deep, each non-string
  value keeping its ORIGINAL literal text (`[1,2]` stays `[1,2]`) and string values decoded; an
  empty string or None is no arguments; a string that is not a JSON object (unparsable,
  whitespace only, or another JSON type) renders verbatim in a `json` element.
"""

from __future__ import annotations

import json

from .common import ChatFormatError

_WS = " \t\n\r"
_DECODER = json.JSONDecoder(strict=False)


def deep_sort(obj):
    if isinstance(obj, dict):
        return {k: deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def compact_json(obj) -> str:
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ChatFormatError(f"value is not JSON-serialisable: {e}") from e


def py_json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def xtml_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    raise ChatFormatError(f"tool-call argument of type {type(value).__name__} is not JSON")


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _parse_object(s: str) -> list[tuple[str, str, str]]:
    """One level of a JSON object string; ValueError if it is not one."""
    i = _skip(s, 0)
    if i >= len(s) or s[i] != "{":
        raise ValueError("not an object")
    i = _skip(s, i + 1)
    out: list[tuple[str, str, str]] = []
    if i < len(s) and s[i] == "}":
        return out
    while True:
        key, i = _DECODER.raw_decode(s, i)
        if not isinstance(key, str):
            raise ValueError("object key is not a string")
        i = _skip(s, i)
        if i >= len(s) or s[i] != ":":
            raise ValueError("expected ':'")
        start = _skip(s, i + 1)
        value, i = _DECODER.raw_decode(s, start)
        out.append((key, xtml_type(value), value if isinstance(value, str) else s[start:i]))
        i = _skip(s, i)
        sep = s[i] if i < len(s) else ""
        i = _skip(s, i + 1)
        if sep == "}":
            return out
        if sep != ",":
            raise ValueError("expected ',' or '}'")


def call_arguments(arguments):
    if arguments is None or arguments == "":
        return "args", []
    if isinstance(arguments, dict):
        return "args", [(str(k), xtml_type(v), v if isinstance(v, str) else py_json(v)) for k, v in arguments.items()]
    if isinstance(arguments, str):
        try:
            return "args", _parse_object(arguments)
        except (ValueError, ChatFormatError):
            return "json", arguments
    raise ChatFormatError("tool-call arguments must be a JSON object string or an object")
