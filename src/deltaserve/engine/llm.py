"""Offline API shaped like vLLM's: `LLM(model_dir, ...).generate(prompts, params)`."""

from __future__ import annotations

import gc
import itertools
import logging
import weakref
from pathlib import Path

import torch
from PIL import Image
from tqdm.auto import tqdm

from ..chat.render import load_chat_template
from ..model.image_processor import ImageProcessor, ImageProcessorError
from ..model.tokenizer import Tokenizer
from .config import EngineConfig
from .core.builder import build_engine
from .dp.client import DPClient
from .request.chat_inputs import chat_prompt
from .request.mm_inputs import check_patch_total
from .request.multimodal import ImageInput, image_input
from .request.outputs import RequestOutput
from .request.sampling_params import SamplingParams
from .request.sequence import InvalidRequestError

log = logging.getLogger(__name__)


class LLM:
    """Loads a checkpoint, sizes the caches and runs requests to completion.

    `LLM(model, dtype, **kwargs)` takes the fields of `EngineConfig` (engine/config.py documents
    them and their defaults) as keyword arguments; `LLM.from_config(config)` takes the config.
    Both start the engine with `build_engine` (engine/core/builder.py): in bfloat16 the native CPU
    kernels are built and loaded there, so no request pays for the compile. With
    `tensor_parallel_size > 1` it also starts the worker processes and creates the process group
    (refused if this process has one already: `parallel.ProcessGroupTaken`); `shutdown()` /
    `close()`, leaving a `with LLM(...)` block, or the `LLM` being collected stops them and leaves
    the group (a start that fails does so before raising), so engines can follow one another in
    one process. With `data_parallel_size = N > 1` it is a client of N
    engine replica processes (engine/dp/client.py: requests routed by prefix, outputs exactly
    one engine's); `model`, `cache`, `engine` and `layout` are then None (they live in the
    replicas), `stats()` sums the replicas' figures and `pool_snapshot()` is refused. With
    `enable_expert_parallel` too the replicas split the routed experts (wide EP,
    engine/core/lockstep.py); a config with `data_parallel_init_method` set is one such replica
    (as a wide-EP replica server builds it). With `skip_tokenizer_init=True` no tokenizer is
    loaded: prompts must be token ids and outputs carry no text.

    Images (K3 checkpoints with a vision tower), as in vLLM: a dict prompt with
    `multi_modal_data={"image": PIL image or list of them}`; its text holds one `<|media_pad|>`
    (or `<|kimi_image_placeholder|>` where the tokenizer has it) per image, its
    `prompt_token_ids` one pad or the expanded block per image. The processor is the checkpoint's
    `preprocessor_config.json`, read on first use.
    """

    def __init__(self, model: str | Path, dtype: torch.dtype | str = "bfloat16", **kwargs):
        self._start(EngineConfig(model=model, dtype=dtype, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self._ids = itertools.count()
        self._processor: ImageProcessor | None = None
        self._chat_template: str | None = None
        self._dp: DPClient | None = None
        if config.data_parallel_size > 1 and config.data_parallel_init_method is None:
            self.tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_pretrained(config.model)
            self._dp = self._parts = DPClient(config, self.tokenizer)
            self.model = self.layout = self.cache = self.engine = None
            self.max_model_len = self._dp.max_model_len
            self._finalizer = weakref.finalize(self, self._dp.shutdown)
            return
        if config.tensor_parallel_size > 1:
            gc.collect()  # an engine no longer referenced but still in a cycle leaves its group now
        parts = build_engine(config)
        self._parts = parts
        self._finalizer = weakref.finalize(self, parts.shutdown)  # holds the parts, never `self`
        self.model, self.tokenizer, self.layout = parts.model, parts.tokenizer, parts.layout
        self.cache, self.engine, self.max_model_len = parts.cache, parts.core, parts.max_model_len

    @property
    def rank_memory(self) -> list[dict[str, int]] | None:
        """Every rank's weight bytes and RSS before / at its peak during load (one entry per rank;
        under data parallelism every replica's ranks, replica by replica)."""
        return self._parts.rank_memory

    def shutdown(self) -> None:
        """Stop the worker (or replica) processes and leave the process group (idempotent; no-op
        for one process)."""
        self._finalizer()

    close = shutdown

    def kill(self) -> None:
        """Kill the worker processes without a collective, for a caller whose engine thread may
        still be inside a step (`shutdown` would then race it on the control group)."""
        if self._dp is None:
            self._parts.kill()
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def _prompt_ids(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int], str | None, list | None]:
        """A prompt is text, token ids, or (as in vLLM) a dict with `prompt` or
        `prompt_token_ids`, an optional `cache_salt` (requests with different salts never share
        cached prefixes) and optional `multi_modal_data`. Returns (text, ids, salt, images)."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"}
            salt = prompt.get("cache_salt")
            if (
                unknown
                or ("prompt" in prompt) == ("prompt_token_ids" in prompt)
                or not (salt is None or isinstance(salt, str))
            ):
                raise InvalidRequestError(
                    "a dict prompt holds exactly one of 'prompt' / 'prompt_token_ids' "
                    "and optionally a string 'cache_salt' and 'multi_modal_data'"
                )
            text, ids = self._prompt_ids(prompt.get("prompt", prompt.get("prompt_token_ids")))[:2]
            return text, ids, salt, self._images(prompt.get("multi_modal_data"))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            return prompt, self.tokenizer.encode(prompt, allow_special=True), None, None
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt), None, None
        raise InvalidRequestError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")

    def _images(self, data) -> list[ImageInput] | None:
        """`multi_modal_data` -> preprocessed images (PIL images, or `ImageInput`s as they are).
        The patches of all of them are counted from their sizes before any pixel is decoded
        (`ImagePatchLimitError` over `max_image_patches_per_request`)."""
        if data is None:
            return None
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidRequestError("multi_modal_data is a dict with one key, 'image'")
        items = data.get("image", [])
        items = items if isinstance(items, (list, tuple)) else [items]
        bad = next((it for it in items if not isinstance(it, ImageInput | Image.Image)), None)
        if bad is not None:
            raise InvalidRequestError(f"an image is a PIL image, got {type(bad).__name__}")
        try:
            if self._processor is None and any(isinstance(it, Image.Image) for it in items):
                self._processor = ImageProcessor.from_pretrained(self.config.model)
            patches = sum(
                it.image.pixel_values.shape[0] if isinstance(it, ImageInput) else self._processor.num_patches(*it.size)
                for it in items
            )
            check_patch_total(patches, self.config.max_image_patches_per_request)
            return [it if isinstance(it, ImageInput) else image_input(it, self._processor) for it in items]
        except (ImageProcessorError, OSError) as e:  # OSError: PIL could not read the pixels
            raise InvalidRequestError(f"image: {e}") from None

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. Every request is validated before any is queued; if the run
        is interrupted, the unfinished requests of this call are aborted (cache freed)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        staged = []
        for prompt, p in zip(prompts, params):
            text, ids, salt, images = self._prompt_ids(prompt)
            rid = str(next(self._ids))
            if self._dp is None:
                self.engine.validate(rid, ids, p, images)
            staged.append((rid, ids, p, text, salt, images))
        if self._dp is not None:
            return self._dp.generate(staged, use_tqdm)
        results: dict[str, RequestOutput] = {}
        try:
            for rid, ids, p, text, salt, images in staged:
                self.engine.add_request(rid, ids, p, prompt=text, cache_salt=salt, images=images)
            with tqdm(total=len(staged), disable=not use_tqdm, desc="generate") as bar:
                while len(results) < len(staged):
                    if not self.engine.scheduler.has_work():
                        raise RuntimeError("engine idle with unfinished requests")
                    for out in self.engine.step():
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            for rid, *_ in staged:
                if rid not in results:
                    self.engine.abort_request(rid)
        return [results[rid] for rid, *_ in staged]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        thinking: bool = True,
    ) -> list[RequestOutput]:
        """`generate` on conversations (one, or a list of them) rendered in the model's chat format
        (`chat.render_chat`; Kimi-Linear with the checkpoint's template). Image parts: see
        `chat_inputs` (PIL images or data URLs)."""
        if self.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer (skip_tokenizer_init=True)")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        if self._chat_template is None:
            self._chat_template = load_chat_template(self.config.model) or ""
        render = dict(tools=tools, add_generation_prompt=add_generation_prompt, thinking=thinking)
        render["chat_template"] = self._chat_template or None
        family = self._dp.family if self._dp is not None else self.model.config.family
        prompts = [self._chat_images(chat_prompt(self.tokenizer, family, c, **render)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_images(self, prompt: dict) -> dict:
        """A rendered conversation with each image's block in place of its pad (so images side by
        side stay separate), the images preprocessed."""
        images = self._images(prompt.get("multi_modal_data"))
        if not images:
            return prompt
        ids = (self._dp or self.engine).image_prompts.expand_rendered(prompt["prompt_token_ids"], images)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}

    def stats(self) -> dict:
        return (self._dp or self.engine).stats()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix no running request shares; True if none is left."""
        return (self._dp or self.cache).reset_prefix_cache()

    def check_integrity(self) -> None:
        (self._dp or self.cache).check_integrity()

    def pool_snapshot(self) -> dict[str, torch.Tensor]:
        """The pools of every rank gathered in the one-process layout (see engine/exec/pool_snapshot.py)."""
        if self._dp is not None:
            raise NotImplementedError("pool_snapshot reads one engine's pools: not with data_parallel_size > 1")
        return self.engine.runner.pool_snapshot()
