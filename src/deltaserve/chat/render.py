"""The chat entry point: `render_chat(tokenizer, family, messages, tools=None,
add_generation_prompt=True, thinking=True, chat_template=None, controls=(), accept_images=True)
-> list[int]` validates the request and hands it to the family's format (`k3.py` or
`kimi_linear.py`); `load_chat_template(dir)` reads a checkpoint's jinja template. With
`accept_images=False` (the server, unless the model serves images) any image part
(`IMAGE_PART_TYPES`) is refused rather than rendered as a pad.
"""

from __future__ import annotations

from pathlib import Path

from .common import ChatFormatError, Special, encode_segments, reject_images, validate_messages, validate_tools
from .k3 import k3_pieces
from .kimi_linear import kimi_linear_ids

FAMILIES = ("kimi_k3", "kimi_linear")


def load_chat_template(model_dir) -> str | None:
    """The checkpoint's `chat_template.jinja` text, or None if it ships none."""
    p = Path(model_dir) / "chat_template.jinja"
    return p.read_text(encoding="utf-8") if p.is_file() else None


def render_chat(
    tokenizer,
    family: str,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    chat_template: str | None = None,
    controls=(),
    accept_images: bool = True,
) -> list[int]:
    """Prompt token ids for `messages` (+ `tools`) in `family`'s chat format.

    `thinking` selects K3's thinking (`<|open|>think<|sep|>`) or non-thinking
    (`<|open|>response<|sep|>`) generation prompt; Kimi-Linear (an instruct model) ignores it.
    `chat_template` (Kimi-Linear only) is a jinja template, e.g. from `load_chat_template`.
    `controls` (K3 only; Kimi-Linear has no such messages) are `(type, body)` control messages.
    `accept_images=False` refuses image parts. Raises `ChatFormatError` for malformed input.
    """
    if family not in FAMILIES:
        raise ChatFormatError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    if not accept_images:
        reject_images(messages)
    validate_messages(messages)
    tools = validate_tools(tools)
    if not isinstance(thinking, bool) or not isinstance(add_generation_prompt, bool):
        raise ChatFormatError("thinking and add_generation_prompt must be booleans")
    if family == "kimi_k3":
        image = (
            "<|kimi_image_placeholder|>"
            if "<|kimi_image_placeholder|>" in tokenizer.special_tokens
            else "<|media_pad|>"
        )
        return encode_segments(
            tokenizer, k3_pieces(messages, tools, add_generation_prompt, thinking, Special(image), controls)
        )
    return kimi_linear_ids(tokenizer, messages, tools, add_generation_prompt, chat_template)
