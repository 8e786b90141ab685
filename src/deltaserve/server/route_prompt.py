"""What the data-parallel front routes a request by: its session and its prompt's chain hashes,
computed as the replica that serves it will (the same chat rendering, `routes.chat.chat_prompt_ids`,
or completion encoding; the same `cache.hashing` chain under the replica's model id, unit and the
request's `cache_salt`), so they name the boundaries the replicas publish (`cache_feed.py`).

Routing never fails a request: a body the front cannot render (malformed, or a chat with image
parts, whose expansion only a replica does) has no hashes and is routed without them; the
replica then answers whatever is wrong with it.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from ..engine.dp.routing import prompt_hashes
from .protocol import ChatRequest
from .routes.chat import chat_prompt_ids
from .state import ServerState

log = logging.getLogger("deltaserve.front")

CHAT = "/v1/chat/completions"


def session_of(body: dict) -> str | None:
    """The session a request names: `prompt_cache_key`, else `cache_salt` (None: neither)."""
    for name in ("prompt_cache_key", "cache_salt"):
        value = body.get(name)
        if isinstance(value, str) and value:
            return f"{name}:{value}"
    return None


class PromptHasher:
    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer, self.chat_template = tokenizer, chat_template

    async def hashes(self, path: str, body: dict, model_id: str, unit: int, family: str) -> list[bytes]:
        """The chain hashes of the request's (first) prompt; [] when it cannot be rendered here."""
        try:
            ids = await self._ids(path, body, family)
        except Exception as e:  # the replica will answer what is wrong with the request
            log.debug("routing %s without prompt hashes: %s", path, e)
            return []
        salt = body.get("cache_salt")
        return prompt_hashes(ids, model_id, salt if isinstance(salt, str) and salt else None, unit)

    async def _ids(self, path: str, body: dict, family: str) -> list[int]:
        if path == CHAT:
            engine = SimpleNamespace(tokenizer=self.tokenizer, family=family, chat_template=self.chat_template)
            state = ServerState(engine, "", None)
            ids, *_ = await chat_prompt_ids(ChatRequest.model_validate(body), state)
            return ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: routed by its first prompt
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.tokenizer.encode, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []
