"""Thinking controls of a chat request (the K3 API contract, README "K3 API contract").

Thinking on/off, first given wins:
1. a named `tool_choice` (`{"type": "function", ...}`) turns thinking off (the reference
   renderers do: a forced call is answered in the response channel);
2. `chat_template_kwargs.thinking` (open-source shape, bool);
3. `thinking`: Moonshot's object `{"type": "enabled"|"disabled", "keep": "all", "effort": ...}`
   (a bool is read as that type; `keep` changes nothing: earlier turns' reasoning is always
   rendered with thinking on, see `protocol.ThinkingConfig`);
4. on.

Effort, first given wins: `chat_template_kwargs.thinking_effort` > `thinking.effort` >
`thinking_effort` > `reasoning_effort`; each in {low, high, max}. None given: the model's own
default (max), and no thinking-effort message is rendered (the vendor ground truths count none).
An effort is rendered only with thinking on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thinking:
    on: bool
    effort: str | None


def resolve_thinking(req) -> Thinking:
    """`Thinking` of a validated `ChatRequest` (see the module docstring for the precedence)."""
    ctk = req.chat_template_kwargs
    obj = req.thinking
    named = req.tool_choice is not None and not isinstance(req.tool_choice, str)
    flags = [
        False if named else None,
        ctk.thinking if ctk else None,
        (obj.type == "enabled") if obj is not None else None,
    ]
    on = next((f for f in flags if f is not None), True)
    efforts = [
        ctk.thinking_effort if ctk else None,
        obj.effort if obj is not None else None,
        req.thinking_effort,
        req.reasoning_effort,
    ]
    effort = next((e for e in efforts if e is not None), None)
    return Thinking(on, effort if on else None)
