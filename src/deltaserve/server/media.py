"""Images in chat requests: OpenAI `image_url` parts -> PIL images, with every limit checked
before a pixel is decoded.

Invariants:
- Sources: `data:image/<png|jpeg|webp|gif>;base64,...` always. `http(s)://` only with
  `allow_remote` (any host) or a host in `allowed_domains` (exact, case-insensitive; when given,
  the list is the only hosts allowed, whatever `allow_remote` says). Under `allow_remote` alone a
  host resolving to a non-public address (loopback, private, link-local) is refused (SSRF). Any
  other scheme (`file:`, `ftp:`, ...) is refused.
- Order: image count (before anything else) -> encoded / downloaded size (before base64
  decoding; a download stops at the cap, the fetch at `fetch_timeout_s`, compressed transfer
  encodings are refused, redirects are followed only to the same host) -> the declared MIME type
  is an accepted one -> header only (only the accepted formats' PIL plugins are tried): the
  actual format equals the declared one, `width * height <= max_pixels` -> once every image's
  header is read: the vision patches of all of them, from their sizes, `<= max_image_patches`
  -> the full decode (`load()`, so truncated or corrupt data fails here) -> the first frame.
- Every refusal is a `MediaError` whose message is for the client (a 400); decoding is CPU work
  that callers run off the event loop (`decode_image` is synchronous; `request_images` runs it
  and the preprocessing on worker threads, at most two images at a time server-wide).
- The prompt: the renderer writes one `<|media_pad|>` (or the tokenizer's
  `<|kimi_image_placeholder|>`) per image; the engine's `ImagePrompts.expand_rendered` replaces
  the i-th with image i's block (spec/model.md §12.6). `vision_processor` reads a vision checkpoint's processor.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import json
import socket
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from PIL import Image, UnidentifiedImageError

from ..chat.common import IMAGE_PART_TYPES
from ..engine.config import DEFAULT_MAX_IMAGE_PATCHES
from ..engine.request.multimodal import ImageInput, image_input
from ..model.image_processor import ImageProcessor, ImageProcessorError

MIB = 2**20
DEFAULT_LIMIT_IMAGES = 4
DEFAULT_MAX_IMAGE_BYTES = 20 * MIB
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000  # 8000x6000 (48 MP) fits
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MIME_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}
_SNIFF = [  # formats recognised only to name them in a refusal
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
]


class MediaError(ValueError):
    """An image the server refuses; the message is for the client."""


@dataclass(frozen=True)
class MediaPolicy:
    """What a request may send: `max_images` per prompt, bytes and pixels per image, where
    remote images may come from."""

    max_images: int = DEFAULT_LIMIT_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allow_remote: bool = False
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    max_image_patches: int = DEFAULT_MAX_IMAGE_PATCHES  # vision patches of all a request's images

    def __post_init__(self):
        if self.max_images < 0 or min(self.max_image_bytes, self.max_image_pixels, self.max_image_patches) < 1:
            raise ValueError("media limits must be positive (max_images >= 0)")
        object.__setattr__(self, "allowed_domains", tuple(d.strip().lower() for d in self.allowed_domains if d.strip()))

    def remote_allowed(self, host: str | None) -> bool:
        if not host:
            return False
        if self.allowed_domains:
            return host.lower() in self.allowed_domains
        return self.allow_remote

    def install_pil_guard(self) -> None:
        """Set PIL's own decompression-bomb guard (process-wide) to this policy's pixel cap: PIL
        refuses past twice it in `Image.open`, `decode_image` past it; PIL's warning between the
        two is silenced (the image is refused anyway)."""
        Image.MAX_IMAGE_PIXELS = self.max_image_pixels
        warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def parse_limit_mm(text: str) -> int:
    """vLLM's `--limit-mm-per-prompt`: `image=N[,video=0]` or JSON `{"image": N}` -> N.
    Only images are served: another modality must be 0."""
    text = text.strip()
    try:
        if text.startswith("{"):
            items = json.loads(text)
            if not isinstance(items, dict):
                raise ValueError
        else:
            items = dict(kv.split("=", 1) for kv in text.split(",") if kv.strip())
        limits = {str(k).strip(): int(v) for k, v in items.items()}
    except (ValueError, TypeError):
        raise ValueError(f'expected image=N or a JSON object like {{"image": N}}, got {text!r}') from None
    if any(v < 0 for v in limits.values()):
        raise ValueError(f"limits must be >= 0, got {text!r}")
    other = [k for k, v in limits.items() if k != "image" and v > 0]
    if other:
        raise ValueError(f"only images are served; {other} must be 0")
    return limits.get("image", DEFAULT_LIMIT_IMAGES)


# ------------------------------------------------------------ finding and fetching


def image_parts(messages) -> list[tuple[str, dict]]:
    """`(where, part)` for every image part of `messages`, in prompt order."""
    out = []
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        parts = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                out.append((f"messages[{i}].content[{j}]", part))
    return out


def check_count(messages, policy: MediaPolicy) -> int:
    """The number of image parts; `MediaError` over `policy.max_images`."""
    n = len(image_parts(messages))
    if n > policy.max_images:
        raise MediaError(f"{n} images in one prompt; at most {policy.max_images} are allowed (--limit-mm-per-prompt)")
    return n


def part_url(part: dict) -> str:
    """The URL of an `image_url` part (`{"url": ...}` or a bare string)."""
    if part.get("type") != "image_url":
        raise MediaError(f"{part.get('type')!r} parts are not supported; send {{'type': 'image_url', ...}}")
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string (a data: URL or an http(s) URL)")
    return url


def data_url_bytes(url: str, policy: MediaPolicy) -> tuple[bytes, str]:
    """`(data, declared MIME)` of a base64 `data:` URL; its size is checked before decoding."""
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("malformed data URL: expected data:image/<type>;base64,<data>")
    params = [p.strip().lower() for p in head.split(";")]
    if params[-1] != "base64":
        raise MediaError("image data URLs must be base64-encoded (data:image/<type>;base64,...)")
    mime = declared_mime(params[0])
    payload = payload.strip()
    if len(payload) > (policy.max_image_bytes + 2) // 3 * 4:
        raise MediaError(f"image over {policy.max_image_bytes} bytes (--max-image-bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("malformed data URL: the payload is not valid base64") from None
    if not data:
        raise MediaError("empty image data")
    if len(data) > policy.max_image_bytes:
        raise MediaError(f"image over {policy.max_image_bytes} bytes (--max-image-bytes)")
    return data, mime


def declared_mime(mime: str) -> str:
    """The accepted MIME type `mime` names (aliases resolved); `MediaError` for any other."""
    mime = MIME_ALIASES.get(mime.strip().lower(), mime.strip().lower())
    if mime not in FORMATS.values():
        accepted = ", ".join(FORMATS.values())
        raise MediaError(f"unsupported image type {mime or '(none)'!r}; accepted: {accepted}")
    return mime


async def fetch(url: str, policy: MediaPolicy) -> tuple[bytes, str | None]:
    """`(data, declared MIME or None)` of an allowed http(s) URL (see the module invariants)."""
    import httpx

    async def get() -> tuple[bytes, str | None]:
        target = httpx.URL(url)
        async with httpx.AsyncClient(follow_redirects=False, timeout=policy.fetch_timeout_s, trust_env=False) as c:
            for _ in range(MAX_REDIRECTS + 1):
                if not policy.remote_allowed(target.host):
                    raise MediaError(f"fetching images from {target.host!r} is not allowed")
                if not policy.allowed_domains:
                    await _check_public(target.host, target.port or (443 if target.scheme == "https" else 80))
                headers = {"Accept-Encoding": "identity", "Accept": ", ".join(FORMATS.values())}
                async with c.stream("GET", target, headers=headers) as r:
                    if r.is_redirect and "location" in r.headers:
                        nxt = target.join(r.headers["location"])
                        if nxt.scheme not in ("http", "https") or nxt.host != target.host:
                            raise MediaError("the image URL redirects to another host, which is not followed")
                        target = nxt
                        continue
                    return await _body(r, policy)
            raise MediaError(f"the image URL redirects more than {MAX_REDIRECTS} times")

    try:
        return await asyncio.wait_for(get(), policy.fetch_timeout_s)
    except MediaError:
        raise
    except asyncio.TimeoutError:
        raise MediaError(f"fetching the image took over {policy.fetch_timeout_s:g} s") from None
    except httpx.InvalidURL:
        raise MediaError("malformed image URL") from None
    except Exception as e:  # any network failure on a client-named URL is the client's 400
        raise MediaError(f"could not fetch the image ({type(e).__name__})") from None


async def _check_public(host: str, port: int) -> None:
    """Refuse a host (under `allow_remote` with no domain list) that resolves to a loopback,
    private, link-local or otherwise non-global address: the server's own network (cloud
    metadata, internal services) is not reachable through a client's image URL. The operator
    opens such a host by listing it in `allowed_domains`."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for *_, addr in infos:
        ip = ipaddress.ip_address(addr[0].split("%")[0])
        if not ip.is_global:
            raise MediaError(
                f"the image host {host!r} resolves to a non-public address; "
                "list it in --allowed-media-domains to allow it"
            )


async def _body(r, policy: MediaPolicy) -> tuple[bytes, str | None]:
    if r.status_code != 200:
        raise MediaError(f"fetching the image answered HTTP {r.status_code}")
    if r.headers.get("content-encoding", "identity").lower() != "identity":
        raise MediaError("the image was sent with a content encoding; only identity is accepted")
    length = r.headers.get("content-length")
    cap = policy.max_image_bytes
    if length is not None and (not length.isdigit() or int(length) > cap):
        raise MediaError(f"image over {cap} bytes (--max-image-bytes)")
    buf = bytearray()
    async for chunk in r.aiter_raw():
        buf += chunk
        if len(buf) > cap:
            raise MediaError(f"image over {cap} bytes (--max-image-bytes)")
    ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
    return bytes(buf), (ctype if ctype.startswith("image/") else None)


async def image_bytes(part: dict, policy: MediaPolicy) -> tuple[bytes, str | None]:
    """`(data, declared MIME or None)` of one image part, from its data URL or a fetch."""
    url = part_url(part)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return data_url_bytes(url, policy)
    if scheme in ("http", "https"):
        try:
            host = urlsplit(url).hostname
        except ValueError:
            raise MediaError("malformed image URL") from None
        if not host:
            raise MediaError("malformed image URL: no host")
        if not policy.remote_allowed(host):
            raise MediaError(
                f"image URLs on {host!r} are not allowed: send the image as a base64 data URL, or start "
                "the server with --allow-remote-media or --allowed-media-domains"
            )
        return await fetch(url, policy)
    raise MediaError(f"image URL scheme {scheme or '(none)'!r} is not supported; use a base64 data URL")


# ------------------------------------------------------------ decoding


def _sniff(data: bytes) -> str | None:
    if data[:4] == b"RIFF" and data[8:12] != b"WEBP":
        return "RIFF (not WebP)"
    return next((name for magic, name in _SNIFF if data.startswith(magic)), None)


def open_image(data: bytes, mime: str | None, policy: MediaPolicy) -> Image.Image:
    """The image with only its header read (format, size): every check short of decoding pixels
    (`MediaError` for a refusal)."""
    if len(data) > policy.max_image_bytes:
        raise MediaError(f"image over {policy.max_image_bytes} bytes (--max-image-bytes)")
    if mime is not None:
        mime = declared_mime(mime)
    try:
        img = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError:
        raise MediaError(f"image over {policy.max_image_pixels} pixels (--max-image-pixels)") from None
    except UnidentifiedImageError:
        other = _sniff(data)
        if other:
            raise MediaError(f"unsupported image format {other}; accepted: {', '.join(FORMATS.values())}") from None
        raise MediaError("the data is not a PNG, JPEG, WebP or GIF image") from None
    except Exception:
        raise MediaError("the image header is corrupt") from None
    actual = FORMATS.get(img.format or "")
    if actual is None:
        raise MediaError(f"unsupported image format {img.format}")
    if mime is not None and mime != actual:
        raise MediaError(f"the image is declared {mime} but its data is {actual}")
    w, h = img.size
    if w < 1 or h < 1:
        raise MediaError(f"image size {w}x{h} is empty")
    if w * h > policy.max_image_pixels:
        raise MediaError(f"image of {w}x{h} pixels is over {policy.max_image_pixels} (--max-image-pixels)")
    return img


def decode_image(data: bytes, mime: str | None, policy: MediaPolicy) -> Image.Image:
    """The decoded image (the first frame of an animation, loaded: no copy of the pixels is made);
    `MediaError` for anything else. Synchronous and CPU-bound: run it off the event loop."""
    img = open_image(data, mime, policy)
    try:
        img.seek(0)
        img.load()
    except Exception:
        raise MediaError("the image data is truncated or corrupt") from None
    return img


def check_patches(sizes: list[tuple[str, tuple[int, int]]], policy: MediaPolicy, processor: ImageProcessor) -> None:
    """`MediaError` unless the images of `(where, (width, height))` fit the processor and have at
    most `policy.max_image_patches` vision patches together (counted from the sizes alone)."""
    total = 0
    for where, (w, h) in sizes:
        try:
            total += processor.num_patches(w, h)
        except ImageProcessorError as e:
            raise MediaError(f"{where}: {e}") from None
    if total > policy.max_image_patches:
        raise MediaError(
            f"the request's images have {total} vision patches; at most {policy.max_image_patches} "
            "are allowed (--max-image-patches-per-request)"
        )


_DECODE_SLOTS = threading.BoundedSemaphore(2)  # images decoded at once, server-wide (memory)


def _prepare(data: bytes, mime: str | None, policy: MediaPolicy, processor: ImageProcessor) -> ImageInput:
    with _DECODE_SLOTS:
        img = decode_image(data, mime, policy)
        try:
            return image_input(img, processor)
        except ImageProcessorError as e:
            raise MediaError(str(e)) from None
        except (ValueError, OSError):
            raise MediaError(f"the {img.format} image (mode {img.mode}) cannot be converted to RGB") from None


async def request_images(messages, policy: MediaPolicy, processor: ImageProcessor) -> list[ImageInput]:
    """Every image part of `messages`, in prompt order, fetched, decoded and preprocessed (the
    CPU work on worker threads); `MediaError` naming the part for the first refusal. Every image's
    header is read, and the request's patch total checked, before any is decoded."""
    check_count(messages, policy)
    fetched = []
    for where, part in image_parts(messages):
        try:
            data, mime = await image_bytes(part, policy)
            fetched.append((where, data, mime, open_image(data, mime, policy).size))
        except MediaError as e:
            raise MediaError(f"{where}: {e}") from None
    check_patches([(where, size) for where, _, _, size in fetched], policy, processor)
    out = []
    for where, data, mime, _ in fetched:
        try:
            out.append(await asyncio.to_thread(_prepare, data, mime, policy, processor))
        except MediaError as e:
            raise MediaError(f"{where}: {e}") from None
    return out


def vision_processor(model_dir, family: str) -> ImageProcessor | None:
    """The image processor of a K3 checkpoint with a vision tower (`vision_config` in its
    config.json), else None; a vision checkpoint without a readable processor config raises
    `ImageProcessorError`."""
    path = Path(model_dir) / "config.json"
    try:
        vision = family == "kimi_k3" and isinstance(json.loads(path.read_text()).get("vision_config"), dict)
    except (OSError, ValueError, AttributeError):
        return None
    return ImageProcessor.from_pretrained(model_dir) if vision else None
