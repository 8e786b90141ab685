"""Remote images over http(s) (a local origin server: allowed fetches, refusals, redirects, the
non-public address guard) and image parts through a live server's chat route."""

import asyncio
import io
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from deltaserve.model.image_processor import ImageProcessor
from deltaserve.server import media
from deltaserve.server.media import MediaError, MediaPolicy, decode_image
from deltaserve.tiny.presets import MEDIA_PROC_CFG
from tests.server.live_server import CHAT, KEY, MODEL, http, idle_and_clean, live_server
from tests.server.test_media import (
    BIG_PNG,
    JPEG,
    MAX_BYTES,
    NOISE_PNG,
    PNG,
    POLICY,
    data_url,
    encode,
    noise,
    part,
    png_header,
)

pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")


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
    # two bomb headers: refused on their sizes' patches (3872 > 2000), before a pixel is decoded
    ([part(data_url(png_header(600, 600)))] * 2, "have 3872 vision patches; at most 2000 are allowed"),
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
        whole_request = "images in one prompt" in message or "patches" in message
        assert err["message"].startswith("messages[0].content[") or whole_request
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
