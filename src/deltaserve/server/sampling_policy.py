"""Vendor sampling policy (`deltaserve serve --sampling-policy k3`): Moonshot's API serves K3
with immutable sampling, and vendors are verified against it.

- "open" (default): the request's sampling fields are used as given (open-source behaviour).
- "k3": chat completions sample with K3's fixed values (temperature 1.0 with thinking on, 0.6
  with it off; top_p 0.95; presence and frequency penalty 0; n 1). A request may send those
  values or leave them out; any other value is a 400 naming the field. `/v1/completions` follows
  the same rule with `thinking=None`: a raw prompt has no thinking switch, so the caller picks
  the mode through the temperature (1.0 or 0.6; absent: 1.0, K3's default thinking mode).
"""

from __future__ import annotations

from .errors import APIError

POLICIES = ("open", "k3")


def k3_fixed(thinking: bool) -> dict:
    return {
        "temperature": 1.0 if thinking else 0.6,
        "top_p": 0.95,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n": 1,
    }


def apply_policy(policy: str, req, kw: dict, thinking: bool | None) -> dict:
    """`kw` (the request's `SamplingParams` keywords) under `policy`; raises `APIError(400)` for
    a value the policy does not allow. `thinking=None` (completions): either mode's temperature."""
    if policy == "open":
        return kw
    either = thinking is None
    if either:
        thinking = req.temperature is None or req.temperature != k3_fixed(False)["temperature"]
    fixed = k3_fixed(thinking)
    for field, value in fixed.items():
        given = getattr(req, field)
        if given is not None and given != value:
            mode = "thinking" if thinking else "non-thinking"
            rule = f"({field}={value} in {mode} mode); send {value} or leave it out"
            if either and field == "temperature":
                rule = "(1.0 in thinking, 0.6 in non-thinking mode); send one of them or leave it out"
            raise APIError(
                400, f"{field}={given!r} is not allowed: this server uses K3's fixed sampling {rule}", param=field
            )
    return {**kw, **fixed}
