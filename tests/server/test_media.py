"""Images in the chat API (`server/media.py`): every bad input is a 400 with a clear message, decided
before the engine, and the server keeps serving; good PNG / JPEG / WebP / GIF inputs decode. The
decoding tests need no engine; the one end-to-end test (the official client sends a base64 PNG)
needs the engine's `add_request(..., images=...)`."""

import argparse
import asyncio
import base64
import io
import random
import re
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from deltaserve.model.image_processor import ImageProcessor
from deltaserve.server import media, serve
from deltaserve.server.media import MediaError, MediaPolicy, decode_image, parse_limit_mm
from deltaserve.server.replica_front import replica_argv
from deltaserve.tiny.presets import MEDIA_PROC_CFG
from tests.server.live_server import CHAT, KEY, MODEL, http, idle_and_clean, live_server

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
MAX_PIXELS = 1_000_000
MAX_BYTES = 64 * 1024
POLICY = MediaPolicy(
    max_images=2,
    max_image_bytes=MAX_BYTES,
    max_image_pixels=MAX_PIXELS,
    allowed_domains=("127.0.0.1",),
    fetch_timeout_s=1.0,
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


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        try:
            self.answer()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher gave up (cap or timeout)

    def answer(self):
        routes = {
            "/ok.png": (200, {"Content-Type": "image/png"}, PNG),
            "/lying.png": (200, {"Content-Type": "image/jpeg"}, PNG),
            "/big.png": (200, {"Content-Type": "image/png"}, BIG_PNG),
            "/gzip.png": (200, {"Content-Type": "image/png", "Content-Encoding": "gzip"}, PNG),
            "/same": (302, {"Location": "/ok.png"}, b""),
            "/other": (302, {"Location": f"http://localhost:{self.server.server_port}/ok.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path == "/endless.png":  # no Content-Length: stopped at the cap
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 4096)
            return
        status, headers, body = routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def origin():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


def test_allowed_fetches(origin):
    for path in ("/ok.png", "/same"):
        data, mime = asyncio.run(media.image_bytes(part(origin + path), POLICY))
        assert (data, mime) == (PNG, "image/png")
        assert decode_image(data, mime, POLICY).size == (20, 12)


def test_any_host_still_excludes_the_servers_own_network(origin):
    """`allow_remote` alone opens public hosts only: a loopback origin needs listing."""
    anywhere = MediaPolicy(allow_remote=True)
    with pytest.raises(MediaError, match="non-public address"):
        asyncio.run(media.image_bytes(part(origin + "/ok.png"), anywhere))
    listed = MediaPolicy(allow_remote=True, allowed_domains=("127.0.0.1",))
    assert asyncio.run(media.image_bytes(part(origin + "/ok.png"), listed))[0] == PNG


FETCH_ERRORS = [
    ("/big.png", f"over {MAX_BYTES} bytes"),
    ("/endless.png", f"over {MAX_BYTES} bytes"),
    ("/gzip.png", "content encoding"),
    ("/other", "redirects to another host"),
    ("/loop", "redirects more than 3 times"),
    ("/slow.png", "took over 1 s"),
    ("/missing.png", "answered HTTP 404"),
]


@pytest.mark.parametrize("path, message", FETCH_ERRORS, ids=[p for p, _ in FETCH_ERRORS])
def test_fetch_refusals(origin, path, message):
    t0 = time.time()
    with pytest.raises(MediaError, match=message):
        asyncio.run(media.image_bytes(part(origin + path), POLICY))
    assert time.time() - t0 < 2.5


def test_fetched_type_mismatch(origin):
    data, mime = asyncio.run(media.image_bytes(part(origin + "/lying.png"), POLICY))
    with pytest.raises(MediaError, match="declared image/jpeg but its data is image/png"):
        decode_image(data, mime, POLICY)


# ------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def vserver(tmp_path_factory):
    """A live tiny-K3 server that accepts images under `POLICY` (PIL's guard restored after)."""
    guard = Image.MAX_IMAGE_PIXELS
    kwargs = dict(api_key=KEY, media=POLICY, image_processor=ImageProcessor(MEDIA_PROC_CFG))
    try:
        with live_server(tmp_path_factory, MODEL, kwargs, max_model_len=512) as srv:
            yield srv
    finally:
        Image.MAX_IMAGE_PIXELS = guard


def chat(server, parts, **kw):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]
    return http(server, "POST", CHAT, json={"model": MODEL, "messages": msgs, "max_tokens": 2, **kw})


def still_serving(server):
    assert http(server, "GET", "/health").json() == {"status": "ok"}
    r = http(
        server, "POST", CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


HTTP_BAD = [
    ([part(data_url(png_header(100_000, 100_000)))], "pixels"),
    ([part(data_url(png_header(1500, 1000)))], "image of 1500x1000 pixels is over"),
    ([part(data_url(NOISE_PNG[:-100]))], "truncated or corrupt"),
    ([part(data_url(JPEG[:2000], "image/jpeg"))], "truncated or corrupt"),
    ([part(data_url(PNG, "image/jpeg"))], "declared image/jpeg but its data is image/png"),
    ([part(data_url(b"not an image at all"))], "not a PNG, JPEG, WebP or GIF image"),
    ([part(data_url(encode(noise(), "BMP"), "image/bmp"))], "unsupported image type 'image/bmp'"),
    ([part(data_url(encode(noise(), "TIFF")))], "unsupported image format TIFF"),
    ([part(data_url(PNG))] * 3, "3 images in one prompt; at most 2 are allowed"),
    ([part(data_url(BIG_PNG))], f"over {MAX_BYTES} bytes"),
    ([part("https://example.com/cat.png")], "--allow-remote-media"),
    ([part("file:///etc/passwd")], "scheme 'file' is not supported"),
    ([part("data:image/png;base64,!!!")], "not valid base64"),
    ([part("data:image/png;base64")], "malformed data URL"),
    ([{"type": "image", "image": "aGVsbG8="}], "'image' parts are not supported"),
]


@pytest.mark.parametrize("parts, message", HTTP_BAD, ids=range(len(HTTP_BAD)))
def test_bad_images_over_http(vserver, parts, message):
    before = vserver["engine"].call_sync(lambda c: c.stats()["requests_added"])
    for stream in (False, True):
        r = chat(vserver, parts, stream=stream)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
        assert message in err["message"] and err["param"] == "messages", err
        assert err["message"].startswith("messages[0].content[") or "images in one prompt" in message
    assert vserver["engine"].call_sync(lambda c: c.stats()["requests_added"]) == before
    still_serving(vserver)


def test_image_in_assistant_message_is_refused(vserver):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part(data_url(PNG))]}]
    r = http(vserver, "POST", CHAT, json={"model": MODEL, "messages": msgs})
    assert r.status_code == 400 and "image parts are not supported here" in r.json()["error"]["message"]


def test_slow_remote_image_does_not_block_the_server(vserver, origin):
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", chat(vserver, [part(origin + "/slow.png")])))
    t.start()
    time.sleep(0.2)
    t0 = time.time()
    still_serving(vserver)
    assert time.time() - t0 < 1.0 and t.is_alive()
    t.join(10)
    assert done["r"].status_code == 400 and "took over 1 s" in done["r"].json()["error"]["message"]


def test_engine_without_images_refuses_them(vserver, monkeypatch):
    monkeypatch.setattr(vserver["engine"], "accepts_images", False)
    r = chat(vserver, [part(data_url(PNG))])
    assert (r.status_code, r.json()["error"]["message"]) == (400, "this engine cannot take images")


def test_tokenize_renders_one_pad_per_image(vserver):
    msgs = [{"role": "user", "content": [part(data_url(PNG)), part("https://example.com/x.png")]}]
    r = http(vserver, "POST", "/tokenize", json={"messages": msgs})
    assert r.status_code == 200 and r.json()["tokens"].count(vserver["tok"].special_tokens["<|media_pad|>"]) == 2


def test_openai_client_sends_a_base64_png(vserver):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=vserver["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
    text = [{"type": "text", "text": "Describe:"}]
    img = noise((40, 30), "RGBA")
    out = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": text + [part(data_url(encode(img, "PNG"))), part(data_url(JPEG, "image/jpeg"))]}
        ],
        max_tokens=3,
    )
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    tok, proc = vserver["tok"], ImageProcessor(MEDIA_PROC_CFG)
    blocks = sum(len(proc(im).prompt_ids(tok)) for im in (img, Image.open(io.BytesIO(JPEG))))
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens + blocks
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": text + [part(data_url(JPEG, "image/jpeg"))]}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 2 and chunks[-1].usage.prompt_tokens > plain.usage.prompt_tokens
    metrics = http(vserver, "GET", "/metrics").text
    counts = dict(re.findall(r"^deltaserve:encoder_cache_(hits|misses)_total\{[^}]*\} (\S+)$", metrics, re.M))
    assert float(counts["misses"]) >= 2 and float(counts["hits"]) >= 1, counts  # the JPEG was re-sent
    idle_and_clean(vserver["engine"])
    still_serving(vserver)
