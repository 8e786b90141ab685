"""K3 image preprocessing (spec/model.md §12.1, §12.6): navit sizes and token counts derived by
hand from the spec formula, alpha compositing, zero padding before normalising, per-channel
normalisation, row-major patch order, config-driven values and the tiny checkpoint's config."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from deltaserve.model.image_processor import (
    PROCESSOR_FILE,
    ImageProcessor,
    ImageProcessorError,
    image_prompt,
    image_prompt_ids,
)
from deltaserve.model.tokenizer import Tokenizer
from deltaserve.tiny import make_tiny

K3_CFG = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 65536,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "transparent_bg_config": {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255,
        "chessboard_gray_value": 180,
    },
    "transparent_bg_fill_stage": "after_resize",
}


def proc(**over):
    return ImageProcessor({**K3_CFG, **over})


def norm(v, mean=0.5, std=0.5):
    return (np.asarray(v, dtype=np.float64) / 255.0 - mean) / std


def canvas(res, p=14):
    """Undo the patchify: [3, H_pad, W_pad] (assumes row-major [C, P, P] patches)."""
    _, gh, gw = res.grid_thw
    return res.pixel_values.reshape(gh, gw, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, gh * p, gw * p)


# (W, H) -> (W', H', pad_w, pad_h, grid_h, grid_w, tokens); P = 14, factor 28, limits 65536 / 512:
# scale = min(1, sqrt(65536 / (max(1, W//14)·max(1, H//14))), 7168/W, 7168/H); W' = int(W·scale)
SIZES = [
    ((1, 1), (1, 1, 27, 27, 2, 2, 1)),  # W//14 = 0 -> max 1; pad 27 on each side
    ((14, 14), (14, 14, 14, 14, 2, 2, 1)),
    ((27, 29), (27, 29, 1, 27, 4, 2, 2)),  # 28 x 56 -> grid 4 x 2 -> (4/2)(2/2)
    ((28, 28), (28, 28, 0, 0, 2, 2, 1)),
    ((100, 100), (100, 100, 12, 12, 8, 8, 16)),  # 112 = 4·28
    ((1920, 1080), (1920, 1080, 12, 12, 78, 138, 2691)),  # 1932/28 = 69, 1092/28 = 39
    ((4000, 3000), (4000, 3000, 4, 24, 216, 286, 15444)),  # 285·214 = 60990 < 65536: no scale
    ((3584, 3584), (3584, 3584, 0, 0, 256, 256, 16384)),  # 256² = 65536 patches exactly
    ((3585, 3584), (3585, 3584, 27, 0, 256, 258, 16512)),  # same budget; padding adds a column
    ((20000, 100), (7168, 35, 0, 21, 4, 512, 512)),  # scale 7168/20000 = 0.3584: per-side cap
    ((100, 20000), (35, 7168, 21, 0, 512, 4, 512)),
    ((50, 30000), (11, 7168, 17, 0, 512, 2, 256)),  # scale 0.23893: 50·s = 11.9 -> 11
    ((7200, 20), (7168, 19, 0, 9, 2, 512, 256)),  # scale 7168/7200: 20·s = 19.9 -> 19
    ((8000, 6000), (4142, 3107, 2, 1, 222, 296, 16428)),  # sqrt(65536/(571·428)) = 0.51785 (§12.1)
    ((10000, 10000), (3585, 3585, 27, 27, 258, 258, 16641)),  # scale 256/714 = 0.35854
]


@pytest.mark.parametrize(("size", "want"), SIZES, ids=[f"{w}x{h}" for (w, h), _ in SIZES])
def test_resize_plan_matches_spec_formula(size, want):
    plan = proc().resize_plan(*size)
    got = (plan.new_width, plan.new_height, plan.pad_width, plan.pad_height, plan.grid_h, plan.grid_w, plan.num_tokens)
    assert got == want
    assert proc().num_tokens(*size) == want[-1]


@pytest.mark.parametrize("size", [(1, 1), (14, 14), (27, 29), (28, 28), (100, 100), (30, 500)])
def test_pipeline_shapes(size):
    p = proc()
    res = p(Image.new("RGB", size, (200, 100, 50)))
    plan = p.resize_plan(*size)
    assert res.grid_thw == (1, plan.grid_h, plan.grid_w)
    assert res.pixel_values.shape == (plan.grid_h * plan.grid_w, 3, 14, 14)
    assert res.pixel_values.dtype == torch.float32
    assert res.num_tokens == plan.num_tokens == (plan.grid_h // 2) * (plan.grid_w // 2)
    assert res.image_size == size


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(orientation):
    """A JPEG tagged to be shown rotated (phone cameras) is processed as shown: same pixels and
    size as the image rotated by hand; an untagged one is processed as it is."""
    import io

    arr = np.zeros((16, 40, 3), dtype=np.uint8)
    arr[:, :8] = (250, 10, 10)  # a red bar on the left of the stored pixels
    arr[12:, :, 1] = 240
    buf = io.BytesIO()
    exif = Image.Image().getexif()
    exif[0x0112] = orientation
    Image.fromarray(arr).save(buf, format="JPEG", quality=95, exif=exif)
    tagged = Image.open(io.BytesIO(buf.getvalue()))
    shown = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_270, 8: Image.Transpose.ROTATE_90}
    by_hand = Image.fromarray(np.asarray(Image.open(io.BytesIO(buf.getvalue())).transpose(shown[orientation])))
    p = proc()
    got, want = p(tagged), p(by_hand)
    assert got.image_size == by_hand.size == ((16, 40) if orientation != 3 else (40, 16))
    assert torch.equal(got.pixel_values, want.pixel_values) and got.grid_thw == want.grid_thw
    plain = Image.open(io.BytesIO(buf.getvalue()))
    plain.getexif()[0x0112] = 1  # the tag says: as stored
    assert torch.equal(p(plain).pixel_values, p(Image.fromarray(np.asarray(plain))).pixel_values)


def test_padding_is_zero_before_normalising():
    res = proc()(Image.new("RGB", (27, 29), (255, 255, 255)))
    x = canvas(res)
    assert x.shape == (3, 56, 28)
    assert torch.all(x[:, :29, :27] == 1.0)
    assert torch.all(x[:, 29:, :] == -1.0) and torch.all(x[:, :, 27:] == -1.0)
    one = canvas(proc()(Image.new("RGB", (1, 1), (0, 255, 0))))
    assert one[:, 0, 0].tolist() == [-1.0, 1.0, -1.0]
    assert torch.all(one.flatten(1)[:, 1:] == -1.0)


def test_patch_order_row_major_channel_first():
    # 56 x 28: grid 2 rows x 4 cols; R = 10·(col in patch), G = 10·(row in patch), B = 20·patch
    a = np.zeros((28, 56, 3), dtype=np.uint8)
    q = np.arange(56) % 14
    r = np.arange(28) % 14
    a[:, :, 0] = 10 * q[None, :]
    a[:, :, 1] = 10 * r[:, None]
    a[:, :, 2] = 20 * ((np.arange(28) // 14)[:, None] * 4 + (np.arange(56) // 14)[None, :])
    res = proc()(Image.fromarray(a))
    assert res.grid_thw == (1, 2, 4) and res.num_tokens == 2
    pv = res.pixel_values.double().numpy()
    for n in range(8):
        np.testing.assert_allclose(pv[n, 0], np.broadcast_to(norm(10 * np.arange(14))[None, :], (14, 14)), atol=1e-6)
        np.testing.assert_allclose(pv[n, 1], np.broadcast_to(norm(10 * np.arange(14))[:, None], (14, 14)), atol=1e-6)
        np.testing.assert_allclose(pv[n, 2], np.full((14, 14), norm(20 * n)), atol=1e-6)


def test_resize_is_pil_bicubic():
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (100, 100, 3), dtype=np.uint8))
    p = proc(in_patch_limit=16)  # sqrt(16/49) = 0.5714 -> 57 x 57, pad 27 -> grid 6 x 6
    res = p(img)
    assert res.grid_thw == (1, 6, 6) and res.num_tokens == 9 and res.image_size == (100, 100)
    want = np.asarray(img.resize((57, 57), Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    x = canvas(res).double().numpy()
    np.testing.assert_allclose(x[:, :57, :57], norm(want), atol=1e-6)
    assert np.all(x[:, 57:] == -1) and np.all(x[:, :, 57:] == -1)


def test_composite_truncates_float32():
    # black at alpha 77: a = 0.30196; white square 0.69804·255 = 177.99 -> 177; gray 0.69804·180 = 125.6 -> 125
    img = Image.new("RGBA", (16, 16), (0, 0, 0, 77))
    x = canvas(proc()(img)).double().numpy()
    np.testing.assert_allclose(x[:, 0, 0], norm([177] * 3), atol=1e-6)
    np.testing.assert_allclose(x[:, 0, 8], norm([125] * 3), atol=1e-6)
    np.testing.assert_allclose(x[:, 8, 8], norm([177] * 3), atol=1e-6)
    la = canvas(proc()(Image.new("LA", (16, 16), (0, 77)))).double().numpy()
    np.testing.assert_allclose(la[:, :16, :16], x[:, :16, :16], atol=0)


def test_palette_transparency_and_grayscale():
    pal = Image.new("P", (16, 16), 0)
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    pal.paste(1, (8, 0, 16, 16))
    pal.info["transparency"] = 0  # index 0 (red) fully transparent -> chessboard shows
    x = canvas(proc()(pal)).double().numpy()
    np.testing.assert_allclose(x[:, 0, 0], norm([255] * 3), atol=1e-6)  # top-left square white
    np.testing.assert_allclose(x[:, 8, 0], norm([180] * 3), atol=1e-6)  # next square gray
    np.testing.assert_allclose(x[:, 3, 12], norm([0, 0, 255]), atol=1e-6)  # opaque blue
    gray = canvas(proc()(Image.new("L", (5, 5), 100))).double().numpy()
    np.testing.assert_allclose(gray[:, :5, :5], np.full((3, 5, 5), norm(100)), atol=1e-6)


def test_alpha_dropped_without_background():
    x = canvas(proc(transparent_bg_config=None)(Image.new("RGBA", (4, 4), (10, 20, 30, 0))))
    np.testing.assert_allclose(x[:, 0, 0].double().numpy(), norm([10, 20, 30]), atol=1e-6)


@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
def test_fill_stage_orders_composite_and_resize(stage):
    rng = np.random.default_rng(1)
    rgba = Image.fromarray(rng.integers(0, 256, (100, 100, 4), dtype=np.uint8))
    res = proc(in_patch_limit=16, transparent_bg_fill_stage=stage)(rgba)
    y, xx = np.mgrid[0:100, 0:100]
    board = np.where(((y // 8) + (xx // 8)) % 2 == 1, 180, 255).astype(np.uint8)[..., None]

    def composite(im):
        a = np.asarray(im).astype(np.float32)
        alpha = a[..., 3:] / np.float32(255)
        n = a.shape[0]
        return (alpha * a[..., :3] + (np.float32(1) - alpha) * board[:n, :n]).astype(np.uint8)

    if stage == "after_resize":
        want = composite(rgba.resize((57, 57), Image.Resampling.BICUBIC))
    else:
        want = np.asarray(Image.fromarray(composite(rgba)).resize((57, 57), Image.Resampling.BICUBIC))
    np.testing.assert_allclose(canvas(res).double().numpy()[:, :57, :57], norm(want.transpose(2, 0, 1)), atol=1e-6)


def test_per_channel_mean_std():
    p = proc(image_mean=[0.1, 0.2, 0.3], image_std=[0.5, 0.25, 2.0])
    x = canvas(p(Image.new("RGB", (3, 3), (255, 255, 255)))).double().numpy()
    np.testing.assert_allclose(x[:, 0, 0], [1.8, 3.2, 0.35], atol=1e-6)
    np.testing.assert_allclose(x[:, -1, -1], [-0.2, -0.8, -0.15], atol=1e-6)
    # bitwise: float32(x/255), then - mean, * (1/std) with float64 operands (upstream arithmetic)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    levels = np.arange(28 * 28 * 3).reshape(28, 28, 3) % 256
    want = (levels / 255.0).astype(np.float32)
    want -= np.array(mean)
    want *= 1.0 / np.array(std)
    got = canvas(proc(image_mean=mean, image_std=std)(Image.fromarray(levels.astype(np.uint8))))
    assert np.array_equal(got.numpy(), want.transpose(2, 0, 1))


def test_config_values_drive_the_result():
    res = proc(patch_size=16)(Image.new("RGB", (1, 1)))
    assert res.pixel_values.shape == (4, 3, 16, 16) and res.grid_thw == (1, 2, 2)
    assert proc(merge_kernel_size=[2, 2]).resize_plan(27, 29) == proc().resize_plan(27, 29)
    assert proc(merge_kernel_size=1).resize_plan(27, 29).num_tokens == 2 * 3  # pad to 28 x 42
    assert proc(in_patch_limit=16384).num_tokens(4000, 3000) == 4200  # scale 0.51830: 2073 x 1554 -> 75 x 56
    assert proc(patch_limit_on_one_side=64).num_tokens(20000, 100) == 32  # 896 x 4 -> 896 x 28 -> 32 x 1
    with pytest.raises(ImageProcessorError, match="patch_limit_on_one_side=5"):
        proc(patch_limit_on_one_side=5).resize_plan(100, 100)  # 70 -> pad 84 -> 6 patches > 5
    white = proc(transparent_bg_config={"pattern": "white"})(Image.new("RGBA", (2, 2), (0, 0, 0, 0)))
    assert canvas(white)[:, 0, 0].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"patch_size": None}, "patch_size"),
        ({"patch_size": 0}, "patch_size"),
        ({"merge_kernel_size": [2, 3]}, "merge_kernel_size"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std"),
        ({"fixed_output_tokens": 256}, "fixed_output_tokens"),
        ({"transparent_bg_fill_stage": "sometime"}, "transparent_bg_fill_stage"),
        ({"transparent_bg_config": {"pattern": "plaid"}}, "plaid"),
        ({"transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8}}, "chessboard_white_value"),
    ],
)
def test_bad_config_values(over, match):
    with pytest.raises(ImageProcessorError, match=match):
        proc(**over)


@pytest.mark.parametrize(
    "key", ["patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean", "image_std"]
)
def test_missing_required_key(key):
    with pytest.raises(ImageProcessorError, match=key):
        ImageProcessor({k: v for k, v in K3_CFG.items() if k != key})


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ImageProcessorError, match="missing"):
        ImageProcessor.from_pretrained(tmp_path)
    (tmp_path / PROCESSOR_FILE).write_text("{not json")
    with pytest.raises(ImageProcessorError, match="JSON"):
        ImageProcessor.from_pretrained(tmp_path)
    (tmp_path / PROCESSOR_FILE).write_text(json.dumps(K3_CFG))
    with pytest.raises(ImageProcessorError, match="media_proc_cfg"):
        ImageProcessor.from_pretrained(tmp_path)
    with pytest.raises(TypeError):
        proc()(np.zeros((4, 4, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("k3"), "kimi_k3")


def test_tiny_k3_writes_processor_config(tiny_k3):
    raw = json.loads((tiny_k3 / PROCESSOR_FILE).read_text())
    assert raw == {"media_proc_cfg": K3_CFG}
    p = ImageProcessor.from_pretrained(tiny_k3)
    assert (p.patch_size, p.merge_kernel_size, p.in_patch_limit, p.patch_limit_on_one_side) == (14, 2, 65536, 512)
    assert p.fill_stage == "after_resize" and p.background.pattern == "chessboard"
    vision = json.loads((tiny_k3 / "config.json").read_text())["vision_config"]
    assert vision["patch_size"] == p.patch_size and vision["merge_kernel_size"] == [p.merge_kernel_size] * 2


def test_prompt_text_and_ids(tiny_k3):
    assert image_prompt(640, 480, 3) == (
        "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_pad|><|media_pad|><|media_end|>"
    )
    tok = Tokenizer.from_pretrained(tiny_k3)
    res = proc()(Image.new("RGB", (27, 29)))
    ids = res.prompt_ids(tok)
    sp = tok.special_tokens
    assert ids[0] == sp["<|media_begin|>"] and ids[-1] == sp["<|media_end|>"]
    assert ids.count(sp["<|media_pad|>"]) == 2
    assert tok.decode(ids) == res.prompt() == image_prompt(27, 29, 2)
    big = image_prompt_ids(tok, 8000, 6000, 16428)  # a pad run far past the 25,000-char split
    assert big.count(sp["<|media_pad|>"]) == 16428 and tok.decode(big) == image_prompt(8000, 6000, 16428)
