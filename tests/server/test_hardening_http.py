"""HTTP hardening (issue 15), on the package's live server (tiny K3, API key) unless noted:
invalid Unicode is a 400 decided before the engine, an unexpected error is a JSON 500 (a stream
ends with an error event, then `[DONE]`), a non-streaming request whose client leaves is
aborted, image parts are refused, the key is checked before the body, `GET /v1/models/{id}`,
and `deltaserve serve --shutdown-timeout` (a subprocess) exits 0 past a half-sent body."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import pytest

from deltaserve.chat.common import ChatFormatError
from deltaserve.chat.render import render_chat
from deltaserve.server.routes import chat as chat_route
from tests.server.live_server import KEY, MAX_LEN, MODEL, http, idle_and_clean, wait_healthy

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
INTERNAL = {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}}
NO_KEY = {
    "error": {
        "message": "invalid or missing API key",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


def invalid(message, param):
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def added(engine) -> int:
    return engine.call_sync(lambda c: c.stats()["requests_added"])


def raw_request(server, path, body: bytes, length=None, key=KEY) -> socket.socket:
    """A socket that has sent a POST's headers and `body` (all of it unless `length` says more)."""
    url = urlsplit(server["url"])
    s = socket.create_connection((url.hostname, url.port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


def read_response(s: socket.socket) -> tuple[bytes, dict]:
    """(status line, JSON body) of one response with a Content-Length, read off a raw socket."""
    s.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
        data.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]
    ):
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return head.split(b"\r\n", 1)[0], json.loads(body)


def sse_events(lines) -> list:
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


# ------------------------------------------------------------ 2: invalid Unicode, catch-all

S = "\\ud800"  # a JSON escape: json.loads turns it into a lone surrogate
SURROGATES = [
    (
        CMPL,
        f'{{"model": "{MODEL}", "prompt": "ab{S}cd", "echo": true, "max_tokens": 3}}',
        "prompt: lone surrogate U+D800 is not valid Unicode text",
        "prompt",
    ),
    (
        CMPL,
        f'{{"model": "{MODEL}", "prompt": "ab{S}cd", "echo": true, "stream": true}}',
        "prompt: lone surrogate U+D800 is not valid Unicode text",
        "prompt",
    ),
    (
        CMPL,
        f'{{"model": "{MODEL}", "prompt": ["ok", "\\udfff"]}}',
        "prompt: prompt[1]: lone surrogate U+DFFF is not valid Unicode text",
        "prompt",
    ),
    (
        CMPL,
        f'{{"model": "{MODEL}", "prompt": "ok", "stop": ["{S}"]}}',
        "stop: stop[0]: lone surrogate U+D800 is not valid Unicode text",
        "stop",
    ),
    (
        CHAT,
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi {S}"}}]}}',
        "messages: messages[0].content: lone surrogate U+D800 is not valid Unicode text",
        "messages",
    ),
    (
        CHAT,
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": [{{"type": "text", '
        f'"text": "{S}"}}]}}], "stream": true}}',
        "messages: messages[0].content[0].text: lone surrogate U+D800 is not valid Unicode text",
        "messages",
    ),
    (
        CHAT,
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "tools": '
        f'[{{"type": "function", "function": {{"name": "f", "description": "x{S}"}}}}]}}',
        "tools: tools[0].function.description: lone surrogate U+D800 is not valid Unicode text",
        "tools",
    ),
    ("/tokenize", f'{{"prompt": "{S}"}}', "prompt: lone surrogate U+D800 is not valid Unicode text", "prompt"),
]


@pytest.mark.parametrize("path,body,message,param", SURROGATES, ids=range(len(SURROGATES)))
def test_lone_surrogates_are_400_before_the_engine(server, path, body, message, param):
    before = added(server["engine"])
    r = http(server, "POST", path, content=body.encode(), headers=dict(JSON))
    assert (r.status_code, r.headers["content-type"]) == (400, "application/json"), r.text
    assert r.json() == invalid(message, param)
    assert added(server["engine"]) == before


def test_surrogate_as_raw_utf8_bytes_is_400(server):
    """The same surrogate sent as (invalid) UTF-8 bytes: json.loads decodes it the same way."""
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "ab\xed\xa0\x80", "echo": true}'
    r = http(server, "POST", CMPL, content=body, headers=dict(JSON))
    assert r.status_code == 400
    assert r.json() == invalid("prompt: lone surrogate U+D800 is not valid Unicode text", "prompt")


def test_unexpected_error_is_a_json_500_and_logged(server, monkeypatch, caplog):
    def boom(*a, **k):
        raise ValueError("secret internals at /srv/x.py")

    monkeypatch.setattr(chat_route, "parse_output", boom)
    with caplog.at_level(logging.ERROR, logger="deltaserve"):
        r = http(
            server,
            "POST",
            CHAT,
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
    assert (r.status_code, r.headers["content-type"]) == (500, "application/json")
    assert r.json() == INTERNAL
    logged = [rec for rec in caplog.records if rec.exc_info and isinstance(rec.exc_info[1], ValueError)]
    assert len(logged) == 1 and logged[0].name == "deltaserve.server.middleware"
    idle_and_clean(server["engine"])


def test_stream_failing_midway_sends_error_then_done(server, monkeypatch, caplog):
    class Failing(chat_route.StreamingParser):
        fed = 0

        def feed(self, text):
            Failing.fed += 1
            if Failing.fed == 3:
                raise KeyError("secret internals")
            return super().feed(text)

    monkeypatch.setattr(chat_route, "StreamingParser", Failing)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "ignore_eos": True,
        "stream": True,
    }
    with caplog.at_level(logging.ERROR, logger="deltaserve"):
        with httpx.stream(
            "POST", server["url"] + CHAT, json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            assert r.status_code == 200
            events = sse_events(list(r.iter_lines()))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2:] == [INTERNAL, "[DONE]"]
    assert all("choices" in e for e in events[:-2])
    assert any(rec.exc_info and isinstance(rec.exc_info[1], KeyError) for rec in caplog.records)
    assert idle_and_clean(server["engine"])["num_running"] == 0


# ------------------------------------------------------------ 3: abandoned non-streaming requests


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Every engine step takes at least 50 ms, so 400 tokens take 20 s or more."""
    runner = server["engine"].core.runner
    orig = runner.execute

    def execute(*a, **k):
        time.sleep(0.05)
        return orig(*a, **k)

    monkeypatch.setattr(runner, "execute", execute)


@pytest.mark.parametrize(
    "path,fields",
    [
        (CMPL, {"prompt": "abandon me"}),
        (CHAT, {"messages": [{"role": "user", "content": "abandon me"}]}),
    ],
)
def test_disconnect_aborts_non_streaming_request(server, slow_steps, path, fields):
    engine = server["engine"]
    before = idle_and_clean(engine)
    body = json.dumps({"model": MODEL, "max_tokens": 400, "ignore_eos": True, **fields}).encode()
    sock = raw_request(server, path, body)
    deadline = time.time() + 30
    while engine.call_sync(lambda c: c.stats()["num_running"]) != 1:
        assert time.time() < deadline, "the request never ran"
        time.sleep(0.05)
    t0 = time.time()
    sock.close()
    stats = idle_and_clean(engine, timeout=8)
    assert time.time() - t0 < 8
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["requests_aborted"] == before["requests_aborted"] + 1
    assert stats["requests_finished"] == before["requests_finished"]
    assert stats["generated_tokens"] - before["generated_tokens"] < 400


# ------------------------------------------------------------ 6: image parts

IMAGE_PARTS = [
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!not-base64"}},
    {"type": "image_url", "image_url": {"url": 5}},
    {"type": "input_image", "image_url": "https://example.com/cat.png"},
    {"type": "image", "image": "aGVsbG8="},
]


@pytest.mark.parametrize("part", IMAGE_PARTS, ids=range(len(IMAGE_PARTS)))
def test_image_parts_are_refused(server, part):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]},
    ]
    expected = invalid(
        f"messages[1].content[1]: this server does not accept image input yet ({part['type']!r} part); send text only",
        "messages",
    )
    before = added(server["engine"])
    for path, body in [
        (CHAT, {"model": MODEL, "messages": msgs}),
        (CHAT, {"model": MODEL, "messages": msgs, "stream": True}),
        ("/tokenize", {"messages": msgs}),
    ]:
        r = http(server, "POST", path, json=body)
        assert (r.status_code, r.json()) == (400, expected), path
    assert added(server["engine"]) == before
    for family in ("kimi_k3", "kimi_linear"):
        with pytest.raises(ChatFormatError) as e:
            render_chat(server["tok"], family, msgs, accept_images=False)
        assert str(e.value) == expected["error"]["message"]


# ------------------------------------------------------------ 8: auth first, GET /v1/models/{id}


@pytest.mark.parametrize(
    "body", [b"{not json", b'{"model": 5}', b"x" * (2 << 20)], ids=["malformed", "invalid", "oversized"]
)
@pytest.mark.parametrize("key", [None, "wrong"])
def test_key_is_checked_before_the_body(server, body, key):
    r = http(server, "POST", CMPL, key=key, content=body, headers=dict(JSON))
    assert (r.status_code, r.json()) == (401, NO_KEY)


def test_unauthenticated_half_sent_body_gets_401_at_once(server):
    with raw_request(server, CMPL, b'{"model": ', length=1000, key=None) as s:
        status, body = read_response(s)
    assert (status, body) == (b"HTTP/1.1 401 Unauthorized", NO_KEY)
    assert http(server, "GET", "/health", key=None).json() == {"status": "ok"}


def test_retrieve_model(server):
    card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "deltaserve", "max_model_len": MAX_LEN}
    r = http(server, "GET", f"/v1/models/{MODEL}")
    assert (r.status_code, r.json()) == (200, card)
    assert http(server, "GET", "/v1/models").json()["data"] == [card]
    for other in ("nope", "org/tiny-k3"):
        r = http(server, "GET", f"/v1/models/{other}")
        assert (r.status_code, r.json()) == (
            404,
            {
                "error": {
                    "message": f"the model {other!r} does not exist",
                    "type": "not_found_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
        )
    r = http(server, "GET", f"/v1/models/{MODEL}", key=None)
    assert (r.status_code, r.json()) == (401, NO_KEY)
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.models.retrieve(MODEL).id == MODEL


# ------------------------------------------------------------ 7: bounded shutdown (a subprocess)


def test_sigterm_exits_0_within_shutdown_timeout_despite_half_sent_body(tmp_path):
    timeout = 1.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.cli", "serve", "--port", str(port), "--shutdown-timeout", str(timeout)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_healthy(proc, port, 120)
        with raw_request({"url": f"http://127.0.0.1:{port}"}, CMPL, b'{"model": ', length=100) as s:
            time.sleep(0.5)  # the request is in the app, waiting for the rest of its body
            t0 = time.time()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout + 15)
            elapsed = time.time() - t0
            status, body = read_response(s)
        assert rc == 0, proc.stdout.read()
        assert timeout <= elapsed < timeout + 10
        assert (status, body) == (
            b"HTTP/1.1 503 Service Unavailable",
            {
                "error": {
                    "message": "the server is shutting down",
                    "type": "service_unavailable",
                    "param": None,
                    "code": None,
                }
            },
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
