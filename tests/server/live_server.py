"""A real server for tests: uvicorn on a loopback port (port 0) in a daemon thread, over a tiny
random K3, torn down with the engine thread; plus the shared test server's settings and helpers."""

import contextlib
import dataclasses
import threading
import time

import httpx
import uvicorn

from deltaserve import LLM
from deltaserve.chat.render import load_chat_template
from deltaserve.server.app import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.tiny import make_tiny


@contextlib.contextmanager
def live_server(tmp_path_factory, model_name: str, app_kwargs: dict, **llm_kwargs):
    """Yields {"url", "engine", "tok", "app"}."""
    ckpt = make_tiny(tmp_path_factory.mktemp("k3"), family="kimi_k3", preset="tiny", seed=0)
    llm = LLM(
        ckpt,
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=512,
        page_size=16,
        kv_cache_memory=64 * 2**20,
        progress=False,
        **llm_kwargs,
    )
    engine = AsyncEngine(llm.engine, llm.model.config.family, load_chat_template(ckpt))
    app = build_app(engine, model_name, **app_kwargs)
    try:
        with run_app(app) as url:
            yield {"url": url, "engine": engine, "tok": llm.tokenizer, "app": app}
    finally:
        engine.shutdown()


@contextlib.contextmanager
def run_app(app):
    """Serve `app` with uvicorn on a loopback port in a daemon thread; yields its base URL."""
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)


KEY = "sk-test-key"
MODEL = "tiny-k3"
MAX_LEN = 512  # room for tool declarations (the tiny vocabulary spends ~1 token per byte)


def http(server, method, path, key=KEY, **kw):
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, server["url"] + path, headers=headers, timeout=60, **kw)


def idle_and_clean(engine, timeout=20.0):
    """Wait until the engine holds no request, then check the cache invariants: no live slot is
    held and every used page is a cached prefix's (prefix caching is on by default)."""
    deadline = time.time() + timeout
    while True:
        busy, stats = engine.call_sync(lambda c: (bool(c.requests), c.stats()))
        if not busy or time.time() > deadline:
            break
        time.sleep(0.05)
    engine.call_sync(lambda c: c.cache.check_integrity())
    cached = stats.get("prefix_cache", {}).get("cached_pages", 0)
    assert not busy and stats["mla_pages_used"] == cached and stats["kda_slots_used"] == 0, stats
    return stats


@contextlib.contextmanager
def unguarded(server):
    """The live server without the K3 channel guard (it is on by default) while the block runs:
    for scripted outputs, which are forced past any grammar."""
    app = server["app"]
    state = app.state.server
    app.state.server = dataclasses.replace(state, channel_guard=False)
    try:
        yield
    finally:
        app.state.server = state


def script_outputs(engine, script: list[int]):
    """Patch the engine's runner so each completed sequence samples `script[len(output)]` (the
    last id once past the end); the model still runs every step. Returns the undo callable."""
    runner = engine.core.runner
    orig = runner.execute

    def execute(scheduled, rows):
        out = orig(scheduled, rows)
        done = [s for s, r in zip(scheduled, rows) if r is not None]
        for j, s in enumerate(done):
            out.token_ids[j] = script[min(len(s.seq.output_ids), len(script) - 1)]
        return out

    runner.execute = execute
    return lambda: setattr(runner, "execute", orig)


def wait_healthy(proc, port: int, timeout: float, poll: float = 0.2) -> None:
    """Wait until the server subprocess `proc` answers /health on `port`."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(poll)


def ready_codes_until_exit(proc, base: str, timeout: float = 20.0) -> list[int]:
    """The `/ready` status codes `base` answers (every 0.1 s) until `proc` exits or `timeout` s pass."""
    codes, t0 = [], time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        try:
            codes.append(httpx.get(f"{base}/ready", timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return codes


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
