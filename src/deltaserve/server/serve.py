"""`deltaserve serve [MODEL_DIR]`: load the engine, wrap it in `AsyncEngine`, run uvicorn.

With no MODEL_DIR it serves the embedded default: a random-weight tiny Kimi K3 checkpoint
(`make_tiny(..., family="kimi_k3", preset="tiny", seed=0)`) generated once, reproducibly, under
the user cache directory. On SIGTERM (or Ctrl-C) in-flight requests are drained for at most
`--shutdown-timeout` seconds, then what is left is cancelled; SIGTERM then exits 0. If the engine
fails (a tensor-parallel rank died or hung), `/ready` answers 503 at once and the server exits 1
`FAILURE_GRACE_S` later, after the same drain.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("deltaserve.serve")

DEFAULT_NAME = "default-kimi_k3-tiny-seed0"
FAILURE_GRACE_S = 1.0  # a failed engine answers /ready 503 this long before the server exits


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deltaserve"


def default_model_dir() -> Path:
    """The embedded default checkpoint, written atomically on first use."""
    from ..tiny import make_tiny

    out = cache_dir() / DEFAULT_NAME
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=DEFAULT_NAME + ".", dir=out.parent))
    try:
        make_tiny(tmp, family="kimi_k3", preset="tiny", seed=0)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _terminated(signum, frame) -> None:
    """SIGTERM outside uvicorn's own handler (before it starts, or re-raised by it once its
    graceful shutdown is done): a requested, clean exit."""
    raise SystemExit(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..engine.config import add_engine_args

    p.add_argument(
        "model",
        nargs="?",
        type=Path,
        default=None,
        help="checkpoint directory (default: the embedded random-weight tiny K3)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the dir name)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("DELTASERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health",
    )
    add_engine_args(p)
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind this server, each with its own caches and tensor-parallel ranks; "
        "requests are routed by prompt prefix so a conversation stays where it is cached",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="queue cap: a completion/chat request arriving while this many requests "
        "wait for the engine gets 429 with Retry-After (negative: no cap)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=5.0,
        help="on SIGTERM, drain in-flight requests for at most this many seconds, then cancel the rest and exit 0",
    )


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.config import EngineConfig
    from ..engine.llm import LLM
    from .app import build_app
    from .async_engine import AsyncEngine
    from .chat.render import load_chat_template

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be >= 1")
    model_dir, name = args.model, args.served_model_name
    if model_dir is None:
        model_dir = default_model_dir()
        name = name or DEFAULT_NAME
        log.warning(
            "no MODEL_DIR given: serving the embedded default, a RANDOM-WEIGHT tiny Kimi K3 "
            "(make_tiny seed 0) at %s; its text is gibberish, the machinery is real",
            model_dir,
        )
    name = name or Path(model_dir).resolve().name
    if args.data_parallel_size > 1:
        return _serve_replicas(args, model_dir, name)
    llm = LLM.from_config(EngineConfig.from_args(args, model=model_dir, progress=False))
    engine = AsyncEngine(llm.engine, llm.model.config.family, load_chat_template(model_dir))
    cap = args.max_waiting_requests
    app = build_app(engine, name, api_key=args.api_key, max_waiting_requests=cap if cap >= 0 else None)
    log.info(
        "serving %r on http://%s:%d (api key %s)", name, args.host, args.port, "required" if args.api_key else "off"
    )
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=args.shutdown_timeout
        )
    )
    engine.on_failure(lambda reason: threading.Timer(FAILURE_GRACE_S, _stop, (server,)).start())
    try:
        server.run()
    finally:
        engine.shutdown()
        llm.shutdown()
    if engine.failure is not None:
        log.error("exiting: %s", engine.failure)
        return 1
    return 0


def _stop(server) -> None:
    server.should_exit = True


def _serve_replicas(args: argparse.Namespace, model_dir: Path, name: str) -> int:
    """`--data-parallel-size N`: N replica servers behind the front (`replica_front`)."""
    import uvicorn

    from . import replica_front as rf

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = rf.replica_argv(args, parser, str(model_dir))
    if "--served-model-name" not in argv:
        argv += ["--served-model-name", name]
    replicas = rf.start_replicas(args.data_parallel_size, argv)
    front = rf.Front(replicas)
    server = uvicorn.Server(
        uvicorn.Config(
            rf.build_front_app(front, args.api_key),
            host=args.host,
            port=args.port,
            log_level="info",
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    rf.watch(front, lambda reason: threading.Timer(FAILURE_GRACE_S, _stop, (server,)).start())
    log.info("serving %r on http://%s:%d over %d replicas", name, args.host, args.port, len(replicas))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run()
    finally:
        front.closing = True
        rf.stop_replicas(replicas, args.shutdown_timeout + 10)
    if front.failure is not None:
        log.error("exiting: %s", front.failure)
        return 1
    return 0
