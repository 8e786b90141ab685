"""`deltaserve serve [MODEL_DIR]`: load the engine, wrap it in `AsyncEngine`, run uvicorn.

With no MODEL_DIR it serves the embedded default: a random-weight tiny Kimi K3 checkpoint
(`make_tiny(..., family="kimi_k3", preset="tiny", seed=0)`) generated once, reproducibly, under
the user cache directory. On SIGTERM (or Ctrl-C) in-flight requests are drained for at most
`--shutdown-timeout` seconds, then what is left is cancelled; SIGTERM then exits 0. If the engine
fails (a tensor-parallel rank died or hung), `/ready` answers 503 at once and the server exits 1
`FAILURE_GRACE_S` later, after the same drain. A K3 checkpoint with a vision tower accepts image
parts in chat requests, under the media flags (`media.py`); the request body cap then grows by
`--limit-mm-per-prompt` base64-encoded `--max-image-bytes` images.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from functools import partial
from pathlib import Path

from . import env

log = logging.getLogger("deltaserve.serve")

DEFAULT_NAME = "kimi-k3-small-chat"
FAILURE_GRACE_S = 1.0  # a failed engine answers /ready 503 this long before the server exits


def default_model_dir() -> Path:
    """The embedded default checkpoint: the trained small K3 shipped in the package."""
    from .tiny.shipped import shipped_model_dir

    return shipped_model_dir("kimi_k3")


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _mm_limit(text: str) -> str:
    """Validated `--limit-mm-per-prompt`, normalised to `image=N` (a plain string, so replica
    servers get it back verbatim)."""
    from .server.media import parse_limit_mm

    try:
        return f"image={parse_limit_mm(text)}"
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def media_policy(args: argparse.Namespace):
    """The `MediaPolicy` of the media flags."""
    from .server.media import MediaPolicy, parse_limit_mm

    domains = [d for item in args.allowed_media_domains or () for d in item.split(",")]
    return MediaPolicy(
        max_images=parse_limit_mm(args.limit_mm_per_prompt),
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        max_image_patches=args.max_image_patches_per_request,
        allow_remote=args.allow_remote_media,
        allowed_domains=tuple(domains),
    )


def _terminated(signum, frame) -> None:
    raise SystemExit(0)


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM outside uvicorn's own handler (before it starts, or re-raised by it once its
    graceful shutdown is done) is a requested, clean exit (status 0, not 143); main thread only."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .engine.config import add_engine_args
    from .roles import add_role_arguments

    p.add_argument(
        "model",
        nargs="?",
        type=Path,
        default=None,
        help="checkpoint directory (default: the embedded random-weight tiny K3)",
    )
    p.add_argument(
        "--sampling-policy",
        choices=["open", "k3"],
        default="open",
        help="k3: Moonshot's immutable sampling (temperature 1.0 thinking / 0.6 not, top_p 0.95, penalties 0, "
        "n 1; other values are a 400); open (default): as the request says",
    )
    p.add_argument(
        "--channel-guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="K3 (on by default): constrain every reply to the XTML message structure by grammar, so "
        "reasoning never lands in content and no markup leaks into it (requests with their own "
        "constraint keep it); --no-channel-guard samples unguarded",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the dir name)")
    p.add_argument(
        "--api-key",
        default=env.API_KEY.get(),
        help="require 'Authorization: Bearer KEY' on every route but /health",
    )
    add_engine_args(p)
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind this server, each with its own caches and tensor-parallel ranks; "
        "requests are routed by prompt prefix so a conversation stays where it is cached; with "
        "--enable-expert-parallel the routed experts are split over every rank of the replicas (wide EP)",
    )
    # a wide-EP replica server's place in its group, given by the front (not for users)
    p.add_argument("--data-parallel-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data-parallel-init-method", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="queue cap: a completion/chat request arriving while this many requests "
        "wait for the engine gets 429 with Retry-After (negative: no cap)",
    )
    _media_arguments(p)
    add_role_arguments(p)
    p.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=5.0,
        help="on SIGTERM, drain in-flight requests for at most this many seconds, then cancel the rest and exit 0",
    )
    p.add_argument(
        "--replica-start-timeout",
        type=_seconds,
        default=900.0,
        help="with --data-parallel-size: seconds a replica gets to load and answer; one that does not is "
        "killed and restarted with backoff (the server exits 1 if none comes up at first)",
    )


def _media_arguments(p: argparse.ArgumentParser) -> None:
    from .server.media import DEFAULT_LIMIT_IMAGES, DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS

    p.add_argument(
        "--allow-remote-media",
        action="store_true",
        help="let image parts name http(s) URLs on any host, fetched by the server (an SSRF risk: "
        "prefer --allowed-media-domains); without it only base64 data URLs are accepted",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="hosts image URLs may be fetched from (exact names; when given, the only ones)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limit,
        default=f"image={DEFAULT_LIMIT_IMAGES}",
        help=f"most images in one chat request: image=N or '{{\"image\": N}}' (default image={DEFAULT_LIMIT_IMAGES})",
    )
    p.add_argument(
        "--max-image-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_IMAGE_BYTES,
        help=f"most bytes of one encoded image (default {DEFAULT_MAX_IMAGE_BYTES})",
    )
    p.add_argument(
        "--max-image-pixels",
        type=_positive_int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help=f"most width*height of one image, read from its header before any decoding "
        f"(default {DEFAULT_MAX_IMAGE_PIXELS})",
    )


def vision_app_kwargs(engine, model_dir: Path, policy) -> dict:
    """`build_app` keywords for images: the processor (a K3 engine with a vision tower), the
    policy and a body cap grown by the images it allows; {} when images are not served."""
    from .model.image_processor import ImageProcessorError
    from .server.media import vision_processor

    if not engine.accepts_images:
        return {}
    try:
        processor = vision_processor(model_dir, engine.family)
    except ImageProcessorError as e:
        log.error("image input is off: %s", e)
        return {}
    if processor is None:
        return {}
    log.info(
        "image input on: at most %d per request, %d bytes, %d pixels each",
        policy.max_images,
        policy.max_image_bytes,
        policy.max_image_pixels,
    )
    return dict(media=policy, image_processor=processor, max_body_bytes=media_body_bytes(policy))


def media_body_bytes(policy) -> int:
    """The request body cap when images are served: the text cap plus `max_images` base64 images."""
    from .server.protocol import MAX_BODY_BYTES

    return MAX_BODY_BYTES + policy.max_images * ((policy.max_image_bytes + 2) // 3 * 4 + 1024)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .chat.render import load_chat_template
    from .engine.config import EngineConfig
    from .engine.exec.ranks import exit_with_parent
    from .engine.llm import LLM
    from .roles import RoleStartError, check_role_arguments, start_role
    from .server.app import build_app
    from .server.async_engine import AsyncEngine
    from .server.lockstep_engine import LockStepEngine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if env.EXIT_WITH_PARENT.pop():  # a replica server of `--data-parallel-size`
        exit_with_parent()
    if args.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be >= 1")
    check_role_arguments(args)
    model_dir, name = args.model, args.served_model_name
    if model_dir is None:
        model_dir = default_model_dir()
        name = name or DEFAULT_NAME
        log.info("no MODEL_DIR given: serving the embedded default, a small trained Kimi K3 (%s)", model_dir)
    name = name or Path(model_dir).resolve().name
    if args.data_parallel_size > 1 and args.data_parallel_rank is None:
        return _serve_replicas(args, model_dir, name)
    wide = {}
    if args.data_parallel_rank is not None:  # a wide-EP replica server: one rank of the front's group
        wide = dict(
            data_parallel_size=args.data_parallel_size,
            data_parallel_rank=args.data_parallel_rank,
            data_parallel_init_method=args.data_parallel_init_method,
        )
    llm = LLM.from_config(EngineConfig.from_args(args, model=model_dir, progress=False, **wide))
    kind = LockStepEngine if llm.model.tp.ep_world > 1 else AsyncEngine
    engine = kind(llm.engine, llm.model.config.family, load_chat_template(model_dir))
    cap = args.max_waiting_requests
    vision = vision_app_kwargs(engine, Path(model_dir), media_policy(args))
    app = build_app(
        engine,
        name,
        api_key=args.api_key,
        max_waiting_requests=cap if cap >= 0 else None,
        sampling_policy=args.sampling_policy,
        channel_guard=args.channel_guard,
        **vision,
    )
    try:
        start_role(app, engine, args)
    except RoleStartError as e:
        stop_engine(engine, llm)
        log.error("%s", e)
        return 1
    log.info(
        "serving %r on http://%s:%d (api key %s)", name, args.host, args.port, "required" if args.api_key else "off"
    )
    exit_cleanly_on_sigterm()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=args.shutdown_timeout
        )
    )
    engine.on_failure(lambda reason: threading.Timer(FAILURE_GRACE_S, _stop, (server,)).start())
    try:
        server.run()
    finally:
        stop_engine(engine, llm)
    if engine.failure is not None:
        log.error("exiting: %s", engine.failure)
        return 1
    return 0


def stop_engine(engine, llm, timeout: float = 10.0) -> None:
    """Shut down in order, one thread on the control group at a time: the engine thread stops
    first (it finishes its step), then the other ranks get `Shutdown` (`llm.shutdown`). A thread
    still inside a step after `timeout` has the workers killed instead (no collective races it)."""
    if engine.shutdown(timeout):
        llm.shutdown()
    else:
        log.error("the engine thread did not stop within %.0f s: killing the worker ranks", timeout)
        llm.kill()


def _stop(server) -> None:
    server.should_exit = True


def _prompt_hasher(model_dir: Path):
    """The front's prompt hasher (`server/route_prompt.py`), or None when the model has no tokenizer."""
    from .chat.render import load_chat_template
    from .model.tokenizer import Tokenizer
    from .server.route_prompt import PromptHasher

    try:
        return PromptHasher(Tokenizer.from_pretrained(model_dir), load_chat_template(model_dir))
    except Exception as e:
        log.warning("the front routes without prompt hashes: no tokenizer (%s)", e)
        return None


def _serve_replicas(args: argparse.Namespace, model_dir: Path, name: str) -> int:
    """`--data-parallel-size N`: N replica servers behind the front (`replica_front`)."""
    import uvicorn

    from . import replica_front as rf
    from .cache.tiers.disk import replica_disk_path
    from .engine.exec.ranks import free_port
    from .server.replica_supervisor import Replica, Supervisor, serve_command

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = rf.replica_argv(args, parser, str(model_dir))
    if "--served-model-name" not in argv:
        argv += ["--served-model-name", name]
    n, stop_s = args.data_parallel_size, args.shutdown_timeout + 10
    argvs = [argv] * n
    if args.enable_expert_parallel:  # wide EP: the replicas are the ranks of one group
        ep = args.distributed_init_method or f"tcp://127.0.0.1:{free_port()}"
        group = ["--data-parallel-size", str(n), "--data-parallel-init-method", ep]
        argvs = [argv + group + ["--data-parallel-rank", str(i)] for i in range(n)]
    if args.kv_disk_path is not None:  # a directory each (one engine per directory)
        at = argv.index("--kv-disk-path") + 1
        argvs = [[*a[:at], replica_disk_path(args.kv_disk_path, i), *a[at + 1 :]] for i, a in enumerate(argvs)]
    supervisor = Supervisor(
        [Replica(i, partial(serve_command, argvs[i])) for i in range(n)], args.replica_start_timeout
    )
    try:
        live = supervisor.start()
    except BaseException:
        supervisor.stop(stop_s)
        raise
    if not live:
        supervisor.stop(stop_s)
        log.error("no data-parallel replica came up: %s", supervisor.failed_start())
        return 1
    front = rf.Front(supervisor.replicas, _prompt_hasher(model_dir), args.api_key)
    server = uvicorn.Server(
        uvicorn.Config(
            rf.build_front_app(front, args.api_key, media_body_bytes(media_policy(args))),
            host=args.host,
            port=args.port,
            log_level="info",
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    supervisor.run()
    log.info("serving %r on http://%s:%d over %d replicas (%d live)", name, args.host, args.port, n, live)
    exit_cleanly_on_sigterm()
    try:
        server.run()
    finally:
        supervisor.stop(stop_s)
    return 0
