"""Chat rendering, prompt encoding and detokenizing run on a worker thread, not on the event
loop (each spied call records whether its thread runs an event loop)."""

import asyncio

import pytest

from deltaserve.server import state
from tests.server.live_server import MODEL, http, idle_and_clean

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def spy(monkeypatch):
    """spy(owner, name): wrap `owner.name`; returns the list of "on the loop?" flags."""

    def install(owner, name):
        real, calls = getattr(owner, name), []

        def wrapped(*a, **k):
            try:
                asyncio.get_running_loop()
                calls.append(True)
            except RuntimeError:
                calls.append(False)
            return real(*a, **k)

        monkeypatch.setattr(owner, name, wrapped)
        return calls

    return install


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
        ("/tokenize", {"messages": USER}),
    ],
)
def test_chat_render_off_loop(server, spy, path, body):
    calls = spy(state, "render_chat")
    r = http(server, "POST", path, json={"model": MODEL, **body})
    assert r.status_code == 200 and calls == [False]
    idle_and_clean(server["engine"])


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": ["a b", "c d"], "max_tokens": 2, "echo": True}),
        ("/tokenize", {"prompt": "a b"}),
    ],
)
def test_encode_off_loop(server, spy, path, body):
    calls = spy(server["engine"].tokenizer, "encode")
    r = http(server, "POST", path, json={"model": MODEL, **body})
    assert r.status_code == 200 and calls and not any(calls)
    idle_and_clean(server["engine"])


def test_decode_off_loop(server, spy):
    calls = spy(server["engine"].tokenizer, "decode")
    r = http(server, "POST", "/detokenize", json={"model": MODEL, "tokens": [1, 2, 3]})
    assert r.status_code == 200 and calls == [False]
