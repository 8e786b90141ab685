"""K3 channel integrity by construction (`--channel-guard`): a grammar over the assistant
message's structure, applied to every K3 chat request that has no other constraint.

    [think: text <|close|>think<|sep|>]  <|open|>response<|sep|> text <|close|>response<|sep|>
    [<|open|>tools<|sep|> call+ <|close|>tools<|sep|>]  <|close|>message<|sep|>  (then EOS)

The output continues the generation prompt, so it starts inside the think element (thinking on)
or inside the response element. On by default for K3 (`--no-channel-guard` turns it off).
`text` never holds a control token nor the two characters `<|` (the start of every XTML marker,
spelt in ordinary BPE tokens), so reasoning can only end where the think element closes and no
channel text can be mistaken for markup. It is a token-level rule (`%text%`), so an element may
close after any token: a reasoning budget's forced think-close is always admitted. The tools
element (only allowed when tools are declared and tool_choice is not "none") holds only
well-formed calls: `call tool="NAME" index="N"` with NAME a declared tool, each argument
`argument key=".." type="string|number|boolean|null|object|array"` or one `json type="object"`
element.
"""

from __future__ import annotations

import json

from ..engine.request.structured import StructuredOutput

TEXT = "%text%"  # non-control tokens never spelling `<|` (engine/request/structured.py)
ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")


def _lit(s: str) -> str:
    return json.dumps(s)


def _tag(name: str, attrs: str = "") -> str:
    return f"<|open|> {_lit(name)} {attrs} <|sep|>".replace("  ", " ")


def _close(name: str) -> str:
    return f"<|close|> {_lit(name)} <|sep|>"


def guard_grammar(think: bool, tool_names: list[str]) -> str:
    """The llguidance Lark grammar (see the module docstring)."""
    rules = []
    head = f"text {_close('think')} " if think else ""
    tools = " tools?" if tool_names else ""
    rules.append(
        f"start: {head}{_tag('response') + ' ' if think else ''}text {_close('response')}{tools} {_close('message')}"
    )
    rules.append(f"text: {TEXT}")
    if tool_names:
        names = " | ".join(_lit(n.replace("&", "&amp;").replace('"', "&quot;")) for n in tool_names)
        types = " | ".join(_lit(t) for t in ARG_TYPES)
        rules += [
            f"tools: {_tag('tools')} call+ {_close('tools')}",
            f'call: <|open|> "call tool=\\"" name "\\" index=\\"" INDEX "\\"" <|sep|> (arg* | json) {_close("call")}',
            f"name: {names}",
            "INDEX: /[1-9][0-9]{0,3}/",
            f'arg: <|open|> "argument key=\\"" KEY "\\" type=\\"" argtype "\\"" <|sep|> text {_close("argument")}',
            'KEY: /[^"<]*/',
            f"argtype: {types}",
            f'json: <|open|> "json type=\\"object\\"" <|sep|> text {_close("json")}',
        ]
    return "\n".join(rules) + "\n"


def channel_guard(think: bool, tool_names: list[str]) -> StructuredOutput:
    return StructuredOutput.raw(guard_grammar(think, tool_names))
