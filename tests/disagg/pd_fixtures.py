"""Prefill, decode and proxy servers in this process (uvicorn threads, one Mooncake transfer
engine each), over tiny fp32 checkpoints with the prefix cache on, and a colocated reference."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deltaserve import LLM
from deltaserve.chat.render import load_chat_template
from deltaserve.proxy import Proxy, build_proxy_app
from deltaserve.roles import add_role_arguments, install_role
from deltaserve.server.app import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.media import vision_processor
from deltaserve.tiny import PRESETS, make_tiny
from tests.server.live_server import run_app

SECRET = "test-shared-secret"
UNIT = 16
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=256,
    page_size=16,
    prefix_match_unit=UNIT,
    enable_prefix_caching=True,
    kv_cache_memory=48 * 2**20,
    max_model_len=1024,
    num_threads=1,
    progress=False,
)


def need_mooncake() -> None:
    """Skip (on a developer machine; fail under CI, which installs it) without the transfer engine."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog: warnings and up
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the Mooncake transfer engine does not import here: {e}", allow_module_level=True)


def tp_checkpoint(root: Path) -> Path:
    """A tiny K3 checkpoint whose heads split over two tensor-parallel ranks."""
    with pytest.MonkeyPatch.context() as m:
        wide = dataclasses.replace(PRESETS[("kimi_k3", "tiny")], kda_heads=4, mla_heads=4, moe_intermediate=128)
        m.setitem(PRESETS, ("kimi_k3", "tp"), wide)
        return make_tiny(root / "k3", "kimi_k3", "tp", seed=11)


def make_llm(ckpt: Path, **engine) -> LLM:
    return LLM(ckpt, "float32", **(ENGINE | engine))


def role_args(role: str, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_role_arguments(p)
    return p.parse_args(["--role", role, "--disagg-secret", SECRET, *extra])


@contextlib.contextmanager
def instance(ckpt: Path, role: str, *extra: str, **engine_options):
    """Yields (url, AsyncEngine, role service) of one instance (`engine_options` over `ENGINE`)."""
    llm = make_llm(ckpt, **engine_options)
    try:
        engine = AsyncEngine(llm.engine, llm.model.config.family, load_chat_template(ckpt))
        app = build_app(engine, "tiny", image_processor=vision_processor(ckpt, llm.model.config.family))
        service = install_role(app, engine, role_args(role, *extra))
        try:
            with run_app(app) as url:
                yield url, engine, service
        finally:
            engine.shutdown()
    finally:
        llm.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(ckpt: Path, role: str, port: int, *extra: str) -> subprocess.Popen:
    """`deltaserve serve` of `ckpt` in a process (group) of its own, set up as `instance` is."""
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", str(ckpt), "--role", role, "--port", str(port)]
    cmd += ["--dtype", "float32", "--disagg-secret", SECRET, "--threads", "1", "--page-size", "16"]
    cmd += ["--served-model-name", "tiny", "--prefix-match-unit", str(UNIT), "--max-model-len", "1024", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@contextlib.contextmanager
def proxy(prefill: list[str], decode: list[str]):
    p = Proxy(prefill, decode, SECRET)
    with run_app(build_proxy_app(p)) as url:
        yield url, p


def state(url: str) -> dict:
    r = httpx.get(url + "/disagg/state", headers={"X-Deltaserve-Secret": SECRET}, timeout=30)
    r.raise_for_status()
    return r.json()


def idle_and_clean(url: str) -> dict:
    """The instance's pools once idle: nothing but the prefix cache holds pages or slots."""
    deadline = time.time() + 30
    while True:
        s = state(url)
        quiet = s["sequences_holding_cache"] == 0 and s.get("transfers_parked", 0) == 0 and s["parked"] == 0
        if quiet or time.time() > deadline:
            break
        time.sleep(0.1)
    assert s["integrity"] == "ok", s
    assert s["sequences_holding_cache"] == 0 and s["parked"] == 0 and s["kda_slots_used"] == 0, s
    assert s["mla_pages_used"] == s["cached_pages"], s
    return s
