"""Images in the chat API (`server/media.py`): every bad input is a 400 with a clear message, decided
before the engine, and the server keeps serving; good PNG / JPEG / WebP / GIF inputs decode. The
decoding tests need no engine; the one end-to-end test (the official client sends a base64 PNG)
needs the engine's `add_request(..., images=...)`."""

import argparse
import asyncio
import base64
import io
import random
import struct
import zlib

import pytest
from PIL import Image

from deltaserve import serve
from deltaserve.model.image_processor import ImageProcessor
from deltaserve.replica_front import replica_argv
from deltaserve.server import media
from deltaserve.server.media import MediaError, MediaPolicy, decode_image, parse_limit_mm
from deltaserve.tiny.presets import MEDIA_PROC_CFG

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
MAX_PIXELS = 1_000_000
MAX_BYTES = 64 * 1024
POLICY = MediaPolicy(
    max_images=2,
    max_image_bytes=MAX_BYTES,
    max_image_pixels=MAX_PIXELS,
    allowed_domains=("127.0.0.1",),
    fetch_timeout_s=1.0,
    max_image_patches=2000,  # two 600x600 images (44x44 patches each) are over it
)


# ------------------------------------------------------------ images


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(size=(64, 64), mode="RGB") -> Image.Image:
    return Image.frombytes(mode, size, random.Random(0).randbytes(size[0] * size[1] * len(mode)))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width x height` and holds one tiny IDAT: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def animated(fmt: str) -> bytes:
    """A red frame, then a blue one."""
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0, lossless=True)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


PNG = encode(Image.new("RGBA", (20, 12), (10, 200, 30, 128)), "PNG")
JPEG = encode(noise(), "JPEG")
BIG_PNG = encode(noise((200, 200)), "PNG")  # over MAX_BYTES
NOISE_PNG = encode(noise(), "PNG")


# ------------------------------------------------------------ decoding, no server


RED = (255, 0, 0)


@pytest.mark.parametrize(
    "data, mime, mode, size, first",
    [
        (PNG, "image/png", "RGBA", (20, 12), (10, 200, 30, 128)),
        (JPEG, "image/jpeg", "RGB", (64, 64), None),
        (JPEG, "image/jpg", "RGB", (64, 64), None),
        (encode(noise(), "WEBP"), "image/webp", "RGB", (64, 64), None),
        (animated("GIF"), "image/gif", None, (8, 8), RED),
        (animated("WEBP"), "image/webp", None, (8, 8), RED),
        (PNG, None, "RGBA", (20, 12), None),
    ],
    ids=["png-rgba", "jpeg", "jpg-alias", "webp", "gif-animated", "webp-animated", "png-undeclared"],
)
def test_good_images_decode(data, mime, mode, size, first):
    img = decode_image(data, mime, POLICY)
    assert img.size == size and (mode is None or img.mode == mode)
    if first is not None:  # PNG's pixels; an animation's first frame
        assert img.convert(img.mode if mode else "RGB").getpixel((0, 0)) == first


BAD_DATA = [
    (png_header(100_000, 100_000), "image/png", f"over {MAX_PIXELS} pixels"),  # PIL's own guard, in open
    (png_header(1500, 1000), "image/png", f"image of 1500x1000 pixels is over {MAX_PIXELS}"),
    (NOISE_PNG[: len(NOISE_PNG) // 2], "image/png", "truncated or corrupt"),
    (NOISE_PNG[:-100], "image/png", "truncated or corrupt"),
    (JPEG[: len(JPEG) * 2 // 3], "image/jpeg", "truncated or corrupt"),
    (PNG, "image/jpeg", "declared image/jpeg but its data is image/png"),
    (JPEG, "image/webp", "declared image/webp but its data is image/jpeg"),
    (b"hello, this is text", "image/png", "not a PNG, JPEG, WebP or GIF image"),
    (encode(noise(), "BMP"), "image/png", "unsupported image format BMP"),
    (encode(noise(), "TIFF"), None, "unsupported image format TIFF"),
    (encode(noise(), "BMP"), "image/bmp", "unsupported image type 'image/bmp'"),
    (PNG, "image/svg+xml", "unsupported image type 'image/svg+xml'"),
    (BIG_PNG, "image/png", f"over {MAX_BYTES} bytes"),
]


@pytest.mark.parametrize("data, mime, message", BAD_DATA, ids=range(len(BAD_DATA)))
def test_bad_images_are_refused(data, mime, message):
    guard = Image.MAX_IMAGE_PIXELS
    POLICY.install_pil_guard()
    try:
        with pytest.raises(MediaError, match=message.replace("+", r"\+")):
            decode_image(data, mime, POLICY)
    finally:
        Image.MAX_IMAGE_PIXELS = guard


BAD_URLS = [
    ("data:image/png;base64", "malformed data URL"),
    ("data:image/png;base64,!!not-base64", "not valid base64"),
    ("data:image/png;base64,aGVsbG8", "not valid base64"),  # bad padding
    ("data:image/png," + PNG.hex(), "must be base64-encoded"),
    ("data:image/png;base64,", "empty image data"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported image type 'text/plain'"),
    ("data:image/png;base64," + "A" * (MAX_BYTES * 2), f"over {MAX_BYTES} bytes"),
    ("https://example.com/cat.png", "'example.com' are not allowed"),
    ("http://localhost/cat.png", "'localhost' are not allowed"),
    ("file:///etc/passwd", "scheme 'file' is not supported"),
    ("http:///etc/passwd", "malformed image URL: no host"),
    ("http://[::1/x", "malformed image URL"),
    ("http://127.0.0.1:99999999/x", "could not fetch the image"),
    ("http://127.0.0.1:1/x", "could not fetch the image"),
    ("ftp://127.0.0.1/cat.png", "scheme 'ftp' is not supported"),
    ("/etc/passwd", "scheme '(none)' is not supported"),
    ("", "non-empty string"),
    (5, "non-empty string"),
]


@pytest.mark.parametrize("url, message", BAD_URLS, ids=range(len(BAD_URLS)))
def test_bad_urls_are_refused(url, message):
    with pytest.raises(MediaError, match=message.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(media.image_bytes(part(url), POLICY))


def test_other_part_shapes():
    assert media.part_url({"type": "image_url", "image_url": "data:x"}) == "data:x"
    with pytest.raises(MediaError, match="'image' parts are not supported"):
        media.part_url({"type": "image", "image": "aGVsbG8="})


def test_limit_mm_per_prompt_syntax():
    assert parse_limit_mm("image=3") == 3
    assert parse_limit_mm('{"image": 5, "video": 0}') == 5
    assert parse_limit_mm("video=0") == media.DEFAULT_LIMIT_IMAGES
    for bad in ("image", "image=x", "image=-1", "video=1", "[1]"):
        with pytest.raises(ValueError):
            parse_limit_mm(bad)


def test_serve_flags():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = ["--allow-remote-media", "--allowed-media-domains", "a.com", "B.org,c.net", "--max-image-bytes", "100"]
    args = parser.parse_args(argv + ["--limit-mm-per-prompt", '{"image": 2}', "--max-image-pixels", "5000"])
    assert serve.media_policy(args) == MediaPolicy(2, 100, 5000, True, ("a.com", "b.org", "c.net"))
    replica = parser.parse_args(replica_argv(args, parser, "m")[1:])
    assert serve.media_policy(replica) == serve.media_policy(args)
    assert serve.media_policy(parser.parse_args([])) == MediaPolicy()
    for bad in (["--limit-mm-per-prompt", "video=1"], ["--max-image-bytes", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_remote_hosts():
    assert not MediaPolicy().remote_allowed("example.com")
    assert MediaPolicy(allow_remote=True).remote_allowed("example.com")
    only = MediaPolicy(allow_remote=True, allowed_domains=("Images.Example.com",))
    assert only.remote_allowed("images.example.com") and not only.remote_allowed("evil.com")
    assert not only.remote_allowed("example.com") and not only.remote_allowed(None)


def test_request_images_in_prompt_order():
    msgs = [
        {"role": "user", "content": [part(data_url(JPEG, "image/jpeg")), {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [part(data_url(PNG))]},
    ]
    images = asyncio.run(media.request_images(msgs, POLICY, ImageProcessor(MEDIA_PROC_CFG)))
    assert [im.image.image_size for im in images] == [(64, 64), (20, 12)]
    assert images[0].digest != images[1].digest
    with pytest.raises(MediaError, match="3 images in one prompt; at most 2"):
        asyncio.run(media.request_images(msgs + msgs[-1:], POLICY, ImageProcessor(MEDIA_PROC_CFG)))


# ------------------------------------------------------------ remote fetches (a local HTTP server)


def test_patch_total_is_checked_on_headers_before_any_decode(monkeypatch):
    """The request's patch total comes from the images' sizes alone: two 600x600 bomb headers
    (44x44 patches each, nothing decodable behind them) are refused on the total, and nothing is
    decoded; one fits and is then decoded (and found truncated)."""
    proc = ImageProcessor(MEDIA_PROC_CFG)
    assert proc.num_patches(600, 600) == 44 * 44
    decoded = []
    real = media._prepare
    monkeypatch.setattr(media, "_prepare", lambda *a: decoded.append(1) or real(*a))
    bomb = part(data_url(png_header(600, 600)))
    msgs = [{"role": "user", "content": [bomb, bomb]}]
    with pytest.raises(MediaError, match=r"have 3872 vision patches; at most 2000 are allowed \(--max-image-patches"):
        asyncio.run(media.request_images(msgs, POLICY, proc))
    assert decoded == []
    with pytest.raises(MediaError, match="truncated or corrupt"):
        asyncio.run(media.request_images([{"role": "user", "content": [bomb]}], POLICY, proc))
    assert decoded == [1]
