"""K3 image preprocessing (spec/model.md §12.1, §12.6-12.7), driven by the checkpoint's
`preprocessor_config.json` → `media_proc_cfg`.

Invariants:
- Every value comes from `media_proc_cfg`. Required: `patch_size`, `merge_kernel_size`,
  `in_patch_limit`, `patch_limit_on_one_side`, `image_mean`, `image_std`. Optional with the
  upstream reader's meaning when absent: `fixed_output_tokens` (null; non-null is refused, the
  tower always yields `(h/m)·(w/m)` rows), `transparent_bg_config` (null: alpha dropped),
  `transparent_bg_fill_stage` ("before_resize"). A present `transparent_bg_config` must spell out
  every field its pattern uses: the upstream dataclass defaults differ from the shipped values.
- An EXIF `Orientation` other than 1 is applied to the pixels first (as vLLM's and transformers'
  image loaders do): the model sees the image as a viewer shows it, and sizes are of that image.
- Resize size: the navit formula (float `scale`, `int()` truncation, per-side cap), PIL BICUBIC.
  Padding comes after the budget, so tokens may exceed `in_patch_limit / m²` slightly.
- Alpha: mode "RGB" as is; an "A" band or a "transparency" entry is composited onto the
  configured background (`a·rgb + (1−a)·bg` in float32, truncated to uint8); any other mode is
  `convert("RGB")`. The fill stage orders compositing against the resize.
- Zero padding right/bottom to multiples of `patch·merge` happens on uint8, before normalising.
- Normalising follows upstream arithmetic: `float32(x/255)`, then `− mean`, `× (1/std)` with
  float64 operands, each result rounded to float32 (a per-channel 256-entry table).
- Patches are row-major over the grid, `[C, P, P]` inside; `grid_thw = (1, H_pad/P, W_pad/P)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageOps

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

PROCESSOR_FILE = "preprocessor_config.json"
_ORIENTATION = 0x0112  # the EXIF tag
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
)
FILL_STAGES = ("before_resize", "after_resize")
_REQUIRED = ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean", "image_std")
_FLAT_BG = {"white": 255, "black": 0, "gray": 128}
_CHESSBOARD_KEYS = (
    "chessboard_square_size",
    "chessboard_square_on_top_left",
    "chessboard_white_value",
    "chessboard_gray_value",
)


class ImageProcessorError(ValueError):
    """A missing or malformed processor config, or an image the config cannot handle."""


@dataclass(frozen=True)
class Background:
    """`transparent_bg_config`: a flat value, or a chessboard whose top-left square is white
    when `on_top_left` (gray squares where `(x//size + y//size) % 2 == on_top_left`)."""

    pattern: str
    square_size: int = 0
    on_top_left: bool = True
    white: int = 255
    gray: int = 0

    def render(self, height: int, width: int) -> np.ndarray:
        """The `[height, width, 3]` uint8 background."""
        if self.pattern in _FLAT_BG:
            return np.full((height, width, 3), _FLAT_BG[self.pattern], dtype=np.uint8)
        y = np.arange(height)[:, None] // self.square_size
        x = np.arange(width)[None, :] // self.square_size
        gray = (x + y) % 2 == (1 if self.on_top_left else 0)
        return np.repeat(np.where(gray, self.gray, self.white).astype(np.uint8)[:, :, None], 3, axis=2)


@dataclass(frozen=True)
class ResizePlan:
    """Resized size, padding and the resulting patch grid / token count of one image."""

    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    grid_h: int
    grid_w: int
    num_tokens: int


@dataclass(frozen=True)
class ProcessedImage:
    """`pixel_values` `[grid_h·grid_w, 3, P, P]` float32; `image_size` is the original (W, H)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int
    image_size: tuple[int, int]

    def prompt(self) -> str:
        return image_prompt(*self.image_size, self.num_tokens)

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        return image_prompt_ids(tokenizer, *self.image_size, self.num_tokens)


def image_prompt(width: int, height: int, num_tokens: int) -> str:
    """The text that replaces one image placeholder (§12.6): original size, N pads."""
    return f"{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}{MEDIA_PAD * num_tokens}{MEDIA_END}"


def image_prompt_ids(tokenizer: Tokenizer, width: int, height: int, num_tokens: int) -> list[int]:
    """`image_prompt` as ids: the markers by name, the size text as ordinary BPE. Built piecewise
    so a long pad run is never cut by the tokenizer's long-run splitting."""
    ids = {}
    for name in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END):
        if name not in tokenizer.special_tokens:
            raise ImageProcessorError(f"the tokenizer has no special token {name!r}")
        ids[name] = tokenizer.special_tokens[name]
    text = tokenizer.encode(f"image {width}x{height}")
    return [ids[MEDIA_BEGIN], *text, ids[MEDIA_CONTENT], *[ids[MEDIA_PAD]] * num_tokens, ids[MEDIA_END]]


def _int(cfg: Mapping, key: str, what: str = "media_proc_cfg") -> int:
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ImageProcessorError(f"{what}.{key} must be a positive int, got {v!r}")
    return v


def _background(cfg) -> Background | None:
    if cfg is None:
        return None
    if not isinstance(cfg, Mapping) or "pattern" not in cfg:
        raise ImageProcessorError(f"transparent_bg_config must be null or an object with a pattern, got {cfg!r}")
    pattern = cfg["pattern"]
    if pattern in _FLAT_BG:
        return Background(pattern)
    if pattern != "chessboard":
        raise ImageProcessorError(
            f"transparent_bg_config.pattern {pattern!r} is not one of {[*_FLAT_BG, 'chessboard']}"
        )
    missing = [k for k in _CHESSBOARD_KEYS if k not in cfg]
    if missing:
        raise ImageProcessorError(f"transparent_bg_config (chessboard) lacks {missing}")
    values = [cfg["chessboard_white_value"], cfg["chessboard_gray_value"]]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in values):
        raise ImageProcessorError(f"chessboard white/gray values must be ints in [0, 255], got {values}")
    if not isinstance(cfg["chessboard_square_on_top_left"], bool):
        raise ImageProcessorError("transparent_bg_config.chessboard_square_on_top_left must be a bool")
    size = _int(cfg, "chessboard_square_size", "transparent_bg_config")
    return Background("chessboard", size, cfg["chessboard_square_on_top_left"], *values)


def fill_transparent_background(image: Image.Image, background: Background | None) -> Image.Image:
    """An RGB image: alpha composited onto `background` (None: alpha dropped)."""
    if background is None:
        return image.convert("RGB")
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    alpha = rgba[:, :, 3:4].astype(np.float32) / np.float32(255.0)
    bg = background.render(*rgba.shape[:2])
    out = alpha * rgba[:, :, :3] + (np.float32(1.0) - alpha) * bg
    return Image.fromarray(out.astype(np.uint8))


class ImageProcessor:
    """Images → patches for K3's tower; see the module docstring for the invariants."""

    def __init__(self, media_proc_cfg: Mapping):
        if not isinstance(media_proc_cfg, Mapping):
            raise ImageProcessorError(f"media_proc_cfg must be an object, got {type(media_proc_cfg).__name__}")
        cfg = media_proc_cfg
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ImageProcessorError(f"{PROCESSOR_FILE} media_proc_cfg lacks required keys {missing}")
        self.patch_size = _int(cfg, "patch_size")
        merge = cfg["merge_kernel_size"]
        if isinstance(merge, list) and len(merge) == 2 and merge[0] == merge[1]:
            merge = merge[0]
        self.merge_kernel_size = _int({"merge_kernel_size": merge}, "merge_kernel_size")
        self.in_patch_limit = _int(cfg, "in_patch_limit")
        self.patch_limit_on_one_side = _int(cfg, "patch_limit_on_one_side")
        self.image_mean = self._triple(cfg, "image_mean")
        self.image_std = self._triple(cfg, "image_std")
        if any(s == 0 for s in self.image_std):
            raise ImageProcessorError(f"media_proc_cfg.image_std has a zero: {self.image_std}")
        if cfg.get("fixed_output_tokens") is not None:
            raise ImageProcessorError(
                f"media_proc_cfg.fixed_output_tokens={cfg['fixed_output_tokens']!r} is unsupported: "
                "the tower's merge always yields (h/m)*(w/m) rows"
            )
        self.background = _background(cfg.get("transparent_bg_config"))
        self.fill_stage = cfg.get("transparent_bg_fill_stage", "before_resize")
        if self.fill_stage not in FILL_STAGES:
            raise ImageProcessorError(f"transparent_bg_fill_stage {self.fill_stage!r} is not one of {FILL_STAGES}")
        self._lut = self._normalise_table()

    @staticmethod
    def _triple(cfg: Mapping, key: str) -> tuple[float, float, float]:
        v = cfg[key]
        if not isinstance(v, list | tuple) or len(v) != 3:
            raise ImageProcessorError(f"media_proc_cfg.{key} must be 3 numbers, got {v!r}")
        if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in v):
            raise ImageProcessorError(f"media_proc_cfg.{key} must be 3 finite numbers, got {v!r}")
        return (float(v[0]), float(v[1]), float(v[2]))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ImageProcessor:
        """Read `<model_dir>/preprocessor_config.json` → `media_proc_cfg`."""
        path = Path(model_dir) / PROCESSOR_FILE
        if not path.is_file():
            raise ImageProcessorError(f"{path} is missing: the checkpoint has no image processor config")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ImageProcessorError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("media_proc_cfg"), dict):
            raise ImageProcessorError(f"{path} has no media_proc_cfg object")
        return cls(data["media_proc_cfg"])

    def _normalise_table(self) -> np.ndarray:
        """`[3, 256]` float32: the normalised value of each uint8 level per channel."""
        x = (np.arange(256, dtype=np.float64) / 255.0).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float64)[:, None]
        std_inv = 1.0 / np.asarray(self.image_std, dtype=np.float64)[:, None]
        return ((x[None, :] - mean).astype(np.float32) * std_inv).astype(np.float32)

    def resize_plan(self, width: int, height: int) -> ResizePlan:
        """The navit resize (§12.1 step 1, 4) of a `width × height` image, with vLLM's per-side check."""
        if width < 1 or height < 1:
            raise ImageProcessorError(f"image size {width}x{height} is empty")
        p, m, side = self.patch_size, self.merge_kernel_size, self.patch_limit_on_one_side
        s1 = math.sqrt(self.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
        scale = min(1.0, s1, side * p / width, side * p / height)
        new_w = min(max(1, int(width * scale)), side * p)
        new_h = min(max(1, int(height * scale)), side * p)
        factor = m * p
        pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
        tok_w, tok_h = (new_w + pad_w) // factor, (new_h + pad_h) // factor
        if tok_h * m > side or tok_w * m > side:
            raise ImageProcessorError(
                f"{width}x{height} gives a {tok_h * m}x{tok_w * m} patch grid, over patch_limit_on_one_side={side}"
            )
        return ResizePlan(new_w, new_h, pad_w, pad_h, tok_h * m, tok_w * m, tok_h * tok_w)

    def num_patches(self, width: int, height: int) -> int:
        """Vision-tower patches (rows of its grid) of a `width × height` image: what its encode costs."""
        plan = self.resize_plan(width, height)
        return plan.grid_h * plan.grid_w

    def num_tokens(self, width: int, height: int) -> int:
        """LLM tokens (= `<|media_pad|>` count) of a `width × height` image."""
        return self.resize_plan(width, height).num_tokens

    def _resized_rgb(self, image: Image.Image, size: tuple[int, int]) -> np.ndarray:
        if self.fill_stage == "before_resize":
            image = fill_transparent_background(image, self.background).resize(size, Image.Resampling.BICUBIC)
        else:
            image = fill_transparent_background(image.resize(size, Image.Resampling.BICUBIC), self.background)
        return np.asarray(image)

    def __call__(self, image: Image.Image) -> ProcessedImage:
        """Resize, composite, pad, normalise and patchify one image."""
        if not isinstance(image, Image.Image):
            raise TypeError(f"expected a PIL image, got {type(image).__name__}")
        if image.getexif().get(_ORIENTATION, 1) != 1:
            image = ImageOps.exif_transpose(image)
        width, height = image.size
        plan = self.resize_plan(width, height)
        rgb = self._resized_rgb(image, (plan.new_width, plan.new_height))
        p, gh, gw = self.patch_size, plan.grid_h, plan.grid_w
        padded = np.zeros((gh * p, gw * p, 3), dtype=np.uint8)
        padded[: plan.new_height, : plan.new_width] = rgb
        patches = padded.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3)  # [gh, gw, C, P, P]
        out = np.empty(patches.shape, dtype=np.float32)
        for c in range(3):
            out[:, :, c] = self._lut[c][patches[:, :, c]]
        pixels = torch.from_numpy(out.reshape(gh * gw, 3, p, p))
        return ProcessedImage(pixels, (1, gh, gw), plan.num_tokens, (width, height))
