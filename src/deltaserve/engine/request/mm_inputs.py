"""Images in prompts: expanding and checking a request's `<|media_pad|>` runs against its images
(`expand_prompt`), and which projector rows a scheduled chunk needs (`chunk_rows`).

Invariants:
- After expansion, image i owns the contiguous pad positions `[starts[i], starts[i] + N_i)` of the
  prompt (N_i = `images[i].image.num_tokens`), in prompt order; position `starts[i] + r` takes
  row r of the image's projector output (spec/model.md §12.6).
- A run of pads in the ids given is image i's span if it has N_i pads; a lone pad is replaced by
  the full block `<|media_begin|>image WxH<|media_content|>` + N_i pads + `<|media_end|>`
  (`image_prompt_ids`, needs the tokenizer). Runs must be separated by other tokens.
- Chunked prefill may split a span anywhere (the rows are indexed per position): a chunk gets
  exactly the rows of the pad positions it covers, and may not reach past the first position of
  an image whose rows are not encoded yet (`blocked_at`): the text before it may run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...model.image_processor import MEDIA_PAD, ImageProcessorError
from .multimodal import ImageInput
from .sequence import InvalidRequestError

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"  # what K3's chat renderer writes per image (§12.6)


class ImagePatchLimitError(InvalidRequestError):
    """A request whose images together have more vision patches than the engine allows."""


def check_patch_total(patches: int, limit: int) -> None:
    """Raise `ImagePatchLimitError` if a request's images have more than `limit` patches."""
    if patches > limit:
        raise ImagePatchLimitError(
            f"the request's images have {patches} vision patches; at most {limit} are allowed "
            "(--max-image-patches-per-request)"
        )


@dataclass(frozen=True)
class MmPrompt:
    """Expanded prompt ids, the images in order and the first pad position of each."""

    ids: list[int]
    images: tuple[ImageInput, ...]
    starts: tuple[int, ...]


def pad_runs(ids: Sequence[int], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the maximal runs of `pad_id` in `ids`."""
    is_pad = np.concatenate([[0], np.asarray(ids, dtype=np.int64) == pad_id, [0]]).astype(np.int8)
    edges = np.diff(is_pad)
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def placeholders_to_pads(ids: list[int], placeholder_id: int | None, pad_id: int) -> list[int]:
    """`ids` with every `placeholder_id` (None: none) read as one `<|media_pad|>`."""
    if placeholder_id is None:
        return ids
    a = np.asarray(ids, dtype=np.int64)
    return np.where(a == placeholder_id, pad_id, a).tolist()


def expand_each_pad(ids: list[int], images: Sequence[ImageInput], pad_id: int, block: Callable) -> list[int]:
    """`ids` rendered with exactly one `pad_id` per image (a chat renderer's output) with pad i
    replaced by `block(images[i])`, so images that sit side by side stay separate runs (which
    `expand_prompt` alone cannot tell from one run). Raises `InvalidRequestError` on a count
    mismatch."""
    at = np.flatnonzero(np.asarray(ids, dtype=np.int64) == pad_id).tolist()
    if len(at) != len(images):
        raise InvalidRequestError(f"the prompt holds {len(at)} <|media_pad|> for {len(images)} image(s)")
    out: list[int] = []
    pos = 0
    for i, im in zip(at, images):
        out += ids[pos:i] + block(im)
        pos = i + 1
    return out + ids[pos:]


def expand_prompt(
    ids: list[int],
    images: Sequence[ImageInput],
    pad_id: int,
    block: Callable[[ImageInput], list[int]] | None,
) -> MmPrompt:
    """Match the pad runs of `ids` to `images` and expand lone pads (see the module invariants);
    `block` gives an image's full block (None: no tokenizer). Raises `InvalidRequestError`."""
    for i, im in enumerate(images):
        if not isinstance(im, ImageInput):
            raise InvalidRequestError(f"image {i} must be an ImageInput, got {type(im).__name__}")
        if im.image.num_tokens < 1:
            raise InvalidRequestError(f"image {i} has no tokens")
    starts, ends = pad_runs(ids, pad_id)
    if len(starts) != len(images):
        raise InvalidRequestError(
            f"the prompt has {len(starts)} <|media_pad|> run(s) for {len(images)} image(s): give each image "
            "either its expanded block or one <|media_pad|>, in order"
        )
    out: list[int] = []
    new_starts: list[int] = []
    pos = 0
    for i, (s, e, im) in enumerate(zip(starts.tolist(), ends.tolist(), images)):
        n = im.image.num_tokens
        out.extend(ids[pos:s])
        if e - s == n:
            new_starts.append(len(out))
            out.extend(ids[s:e])
        elif e - s == 1:
            if block is None:
                raise InvalidRequestError(
                    f"image {i}: expanding one <|media_pad|> to {n} needs a tokenizer; send the expanded block"
                )
            b = block(im)
            new_starts.append(len(out) + b.index(pad_id))
            out.extend(b)
        else:
            raise InvalidRequestError(
                f"image {i}: a run of {e - s} <|media_pad|> tokens for an image of {n} tokens "
                f"(send {n}, or one to have it expanded)"
            )
        pos = e
    out.extend(ids[pos:])
    return MmPrompt(out, tuple(images), tuple(new_starts))


@dataclass(frozen=True)
class ChunkRows:
    """Rows `[lo, hi)` of `image` go to packed positions `[at, at + hi - lo)` of the step."""

    image: ImageInput
    lo: int
    hi: int
    at: int


def chunk_rows(
    images: Sequence[ImageInput], starts: Sequence[int], first: int, stop: int, packed_start: int
) -> list[ChunkRows]:
    """The image rows a chunk of positions `[first, stop)` of one sequence, packed from
    `packed_start`, needs."""
    out = []
    for im, s in zip(images, starts):
        lo, hi = max(first, s), min(stop, s + im.image.num_tokens)
        if lo < hi:
            out.append(ChunkRows(im, lo - s, hi - s, packed_start + lo - first))
    return out


def pending_images(images: Sequence[ImageInput], starts: Sequence[int], computed: int) -> list[ImageInput]:
    """The images whose span ends past position `computed` (still needed), in order."""
    return [im for im, s in zip(images, starts) if s + im.image.num_tokens > computed]


def blocked_at(
    images: Sequence[ImageInput], starts: Sequence[int], start: int, ready: Callable[[bytes], bool]
) -> int | None:
    """The first position at or after `start` whose image rows are not `ready` (a sequence may
    compute up to it), or None if every image it still needs is ready."""
    for im, s in zip(images, starts):
        if s + im.image.num_tokens > start and not ready(im.digest):
            return max(s, start)
    return None


def gather_rows(
    needed: list[ChunkRows], rows_of: dict[bytes, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed positions [M] long, rows [M, D]) for `KimiForCausalLM.forward`'s `embeds`."""
    if not needed:
        return None
    index = torch.cat([torch.arange(c.at, c.at + c.hi - c.lo) for c in needed])
    rows = torch.cat([rows_of[c.image.digest][c.lo : c.hi] for c in needed])
    return index, rows


class ImagePrompts:
    """What the engine checks of a request's images (`prepare`): a vision tower to encode them
    (`encoder`), the pad id (the tokenizer's, else config.json's), runs matched and lone pads
    expanded, every image fitting its grid, at most `max_patches` patches in all, the expanded
    prompt within `max_model_len`."""

    def __init__(self, tokenizer, config_pad_id: int | None, encoder, max_model_len: int, max_patches: int):
        special = tokenizer.special_tokens if tokenizer is not None else {}
        self.tokenizer, self.encoder, self.max_model_len = tokenizer, encoder, max_model_len
        self.max_patches = max_patches
        self.pad_id = special.get(MEDIA_PAD, config_pad_id)
        self.placeholder_id = special.get(IMAGE_PLACEHOLDER)

    def block(self, im: ImageInput) -> list[int]:
        return im.image.prompt_ids(self.tokenizer)

    def expand_rendered(self, ids: list[int], images: Sequence[ImageInput]) -> list[int]:
        """A chat renderer's `ids` (one pad or placeholder per image) with each image's block in
        place (`expand_each_pad`); raises `InvalidRequestError` without a vision tower or tokenizer."""
        if self.encoder is None or self.pad_id is None or self.tokenizer is None:
            raise InvalidRequestError("this model has no vision tower: requests with images are refused")
        ids = placeholders_to_pads(ids, self.placeholder_id, self.pad_id)
        return expand_each_pad(ids, images, self.pad_id, self.block)

    def prepare(self, prompt_ids: list[int], images) -> MmPrompt:
        """The request's `MmPrompt`; raises `InvalidRequestError` for anything refused."""
        if self.encoder is None:
            raise InvalidRequestError("this model has no vision tower: requests with images are refused")
        if not isinstance(images, list | tuple):
            raise InvalidRequestError(f"images must be a list of ImageInput, got {type(images).__name__}")
        if self.pad_id is None:
            raise InvalidRequestError("neither the tokenizer nor config.json names the <|media_pad|> id")
        try:
            ids = placeholders_to_pads(list(prompt_ids), self.placeholder_id, self.pad_id)
            mm = expand_prompt(ids, images, self.pad_id, None if self.tokenizer is None else self.block)
        except ImageProcessorError as e:
            raise InvalidRequestError(str(e)) from None
        for i, im in enumerate(mm.images):
            try:
                self.encoder.check(im)
            except ValueError as e:
                raise InvalidRequestError(f"image {i}: {e}") from None
        check_patch_total(sum(im.image.pixel_values.shape[0] for im in mm.images), self.max_patches)
        if len(mm.ids) > self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(mm.ids)} tokens with its images is longer than max_model_len={self.max_model_len}"
            )
        return mm
