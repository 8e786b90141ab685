"""A prompt's images over the control plane: the decode instance sends each image's preprocessed
pixels with its digest (`ImagePixels`); the prefill instance rebuilds the `ImageInput`, refusing
one whose pixels do not hash to the digest (the digest is the image's key in its prefix and
encoder caches), encodes it and computes the prompt. The decode instance never encodes an image
whose span ends before the last prompt token (the rows arrive as cache); a prompt whose last
token lies in an image span is computed locally (`DecodeHandoff._plan`, counted as bypass
reason "images")."""

from __future__ import annotations

import torch

from ..engine.request.multimodal import ImageInput, image_digest
from ..model.image_processor import ProcessedImage
from .protocol import ImagePixels


def pack_image(im: ImageInput) -> ImagePixels:
    p = im.image
    pixels = p.pixel_values.to(torch.float32).contiguous()
    return ImagePixels(
        im.digest.hex(),
        tuple(p.grid_thw),
        p.num_tokens,
        tuple(p.image_size),
        list(pixels.shape),
        pixels.numpy().tobytes(),
    )


def unpack_image(msg: ImagePixels) -> ImageInput:
    """The `ImageInput` of `msg`; `ValueError` if its shape, size or digest do not hold."""
    numel = 1
    for n in msg.shape:
        numel *= n
    if len(msg.shape) != 4 or msg.shape[0] != msg.grid_thw[0] * msg.grid_thw[1] * msg.grid_thw[2]:
        raise ValueError(f"pixel shape {msg.shape} does not match the grid {msg.grid_thw}")
    if len(msg.pixels) != numel * 4 or msg.num_tokens < 1:
        raise ValueError("the pixels' size or the image's token count is wrong")
    pixels = torch.frombuffer(bytearray(msg.pixels), dtype=torch.float32).reshape(msg.shape)
    processed = ProcessedImage(pixels, tuple(msg.grid_thw), msg.num_tokens, tuple(msg.image_size))
    digest = image_digest(processed)
    if digest.hex() != msg.digest:
        raise ValueError("an image's pixels do not hash to its digest")
    return ImageInput(processed, digest)


def last_in_image(num_tokens: int, spans: tuple[tuple[int, int, bytes], ...]) -> bool:
    """Whether the last of `num_tokens` prompt positions lies in an image span (its rows would be
    needed on the decode side)."""
    return any(s <= num_tokens - 1 < e for s, e, _ in spans)
