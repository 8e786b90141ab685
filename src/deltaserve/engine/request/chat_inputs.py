"""`LLM.chat`'s input: OpenAI-style messages -> the token-form prompt `LLM.generate` takes.

Offline image parts are `{"type": "image_pil", "image_pil": PIL.Image}` (as in vLLM) or
`{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`; the input is the
caller's own, so data URLs are decoded without the server's limits (`server/media.py` guards
requests from the network) and remote URLs are refused. The renderer writes one
`<|media_pad|>` per image part, in message order; the engine expands each to the image's block.
"""

from __future__ import annotations

import base64
import binascii
import io

from PIL import Image

from ...chat.common import ChatFormatError
from ...chat.render import render_chat
from .sequence import InvalidRequestError


def _pil_of(part: dict, where: str) -> Image.Image:
    if part.get("type") == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"{where}: image_pil must be a PIL image")
        return image
    url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
    if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
        raise InvalidRequestError(f"{where}: offline image_url parts must be data URLs")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1], validate=True)))
        image.load()
    except (binascii.Error, OSError, ValueError) as e:
        raise InvalidRequestError(f"{where}: not a readable image ({e})") from None
    return image


def chat_prompt(tokenizer, family: str, messages: list[dict], **render) -> dict:
    """`{"prompt_token_ids": ..., "multi_modal_data": {"image": [...]}}` for one conversation;
    `render` goes to `render_chat` (tools, add_generation_prompt, thinking, chat_template)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise InvalidRequestError("a conversation is a list of message dicts")
    images, shown = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            shown.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image_pil", "image_url"):
                images.append(_pil_of(part, f"messages[{i}].content[{j}]"))
                part = {"type": "image_url", "image_url": {"url": "offline"}}
            parts.append(part)
        shown.append({**m, "content": parts})
    try:
        ids = render_chat(tokenizer, family, shown, **render)
    except ChatFormatError as e:
        raise InvalidRequestError(str(e)) from None
    prompt: dict = {"prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt
