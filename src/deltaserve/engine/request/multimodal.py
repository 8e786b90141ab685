"""Images in requests: `ImageInput` is one preprocessed image and its content digest, the unit the
engine, the prefix cache and the encoder cache key on.

A request's prompt ids carry, for image i (in order), either the expanded block
`<|media_begin|>image WxH<|media_content|>` + N_i x `<|media_pad|>` + `<|media_end|>` or one
`<|media_pad|>` that the engine expands (spec/model.md §12.6); `images[i].image.num_tokens` is
N_i. The digest covers the normalised pixels and the grid, so two images that preprocess alike
are one image to every cache, and two of the same size but different content never are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from PIL import Image

from ...model.image_processor import ImageProcessor, ProcessedImage


@dataclass(frozen=True)
class ImageInput:
    image: ProcessedImage
    digest: bytes  # sha256 over grid_thw and the float32 pixel values


def image_input(image: Image.Image, processor: ImageProcessor) -> ImageInput:
    """Preprocess a PIL image and digest the result."""
    processed = processor(image)
    return ImageInput(processed, image_digest(processed))


def image_digest(processed: ProcessedImage) -> bytes:
    """sha256 over the grid and the float32 pixel values: an image's key in every cache."""
    h = hashlib.sha256(repr(processed.grid_thw).encode())
    h.update(processed.pixel_values.contiguous().numpy().tobytes())
    return h.digest()
