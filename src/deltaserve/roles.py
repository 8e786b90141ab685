"""`serve --role prefill|decode`: the flags, and what each role adds to the OpenAI app.

Both roles keep every OpenAI route (a prefill instance also serves requests itself; a decode
instance serves any request that names no prefill instance) and add the authenticated
`/disagg/*` routes. Both run with the hybrid prefix cache on. An instance may run tensor
parallel, on one machine or several (each rank moves its own share of a handoff and advertises
its node's `--kv-transfer-host`; the two instances' `--tensor-parallel-size` may differ: the KDA
heads move in head blocks, `disagg/plan.py`); decode context and data parallelism are refused (a
handoff moves whole MLA pages of one engine). `--kv-transfer-protocol` picks Mooncake's transport.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from pydantic import ValidationError

from .disagg.decode import DecodeHandoff, PrefillTarget
from .disagg.prefill import PrefillService
from .disagg.protocol import load_secret
from .disagg.ranks import InstanceRanks
from .disagg.service import BypassCollector, CounterCollector
from .engine.exec.rank_transfer import HOST_ENV
from .parallel.kv_transfer import PROTOCOLS, TransferError, check_protocol
from .server.errors import APIError
from .server.protocol import ChatRequest, CompletionRequest
from .server.routes.chat import chat_prompt_ids

log = logging.getLogger("deltaserve.disagg")
ROLES = ("both", "prefill", "decode")


def add_role_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="prefill/decode disaggregation: 'prefill' computes prompts for decode instances, 'decode' "
        "takes them over and generates (behind `deltaserve proxy`); 'both' (default) is a plain server",
    )
    p.add_argument(
        "--disagg-secret",
        default=None,
        help="shared secret of the instances' internal routes (default: $DELTASERVE_DISAGG_SECRET, else a "
        "per-user file under ~/.cache/deltaserve that instances on one machine share)",
    )
    p.add_argument("--kv-transfer-engine", choices=("mooncake",), default="mooncake", help="the transfer engine")
    p.add_argument(
        "--kv-transfer-protocol",
        choices=PROTOCOLS,
        default="tcp",
        help="the transfer engine's transport: tcp (default) or rdma (Mooncake picks the RDMA devices; "
        "refused on a machine that lists none)",
    )
    p.add_argument(
        "--kv-transfer-host",
        default="127.0.0.1",
        help="the address peers reach this instance's transfer engines at (default: loopback); under "
        "--nnodes each node gives its own",
    )
    p.add_argument(
        "--disagg-on-failure",
        choices=("recompute", "error"),
        default="recompute",
        help="decode role: when a handoff fails verification or its peer, recompute the prompt here "
        "(default) or fail the request with 502",
    )
    p.add_argument(
        "--disagg-local-prefill-tokens",
        type=int,
        default=0,
        help="decode role: compute a prompt here, without a prefill instance, when this instance's own "
        "prefix-cache hit (MLA pages and a KDA checkpoint) leaves at most this many tokens (0: never)",
    )
    p.add_argument(
        "--disagg-park-timeout",
        type=float,
        default=60.0,
        help="prefill role: free a computed prompt no decode instance has read after this many seconds",
    )


def check_role_arguments(args: argparse.Namespace) -> None:
    """Refuse what a role cannot run with, turn the prefix cache on, and export this node's
    transfer host to the ranks it starts (on every node of a multi-node instance)."""
    if args.role == "both":
        return
    if args.decode_context_parallel_size != 1 or args.data_parallel_size != 1:
        raise SystemExit(f"--role {args.role} runs one engine: no decode-context or data parallelism")
    try:
        check_protocol(args.kv_transfer_protocol)  # before the model loads
    except TransferError as e:
        raise SystemExit(f"--role {args.role}: {e}") from None
    os.environ[HOST_ENV] = args.kv_transfer_host  # this node's ranks (spawned later) advertise it
    if not args.enable_prefix_caching:
        log.info("--role %s: the hybrid prefix cache is on (both sides cache what they hold)", args.role)
        args.enable_prefix_caching = True


class RoleStartError(RuntimeError):
    """A role (or the proxy) could not start: its transfer engine, secret or instance list. One
    line, for the operator; the process exits 1 (`serve`, `run_proxy`)."""


def start_failure(what: str, e: BaseException) -> RoleStartError:
    """`e`, raised while `what` started, as one line (the traceback only at debug level)."""
    log.debug("%s: start-up failed", what, exc_info=e)
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return RoleStartError(f"{what} did not start: {text}")


def start_role(app, engine, args: argparse.Namespace, ranks: InstanceRanks | None = None) -> object | None:
    """`install_role`, any failure raised as a `RoleStartError`."""
    try:
        return install_role(app, engine, args, ranks)
    except Exception as e:
        raise start_failure(f"--role {args.role}", e) from None


def install_role(app, engine, args: argparse.Namespace, ranks: InstanceRanks | None = None) -> object | None:
    """Add the role's routes (and, for decode, its handoff) to `app`; returns the service. `ranks`:
    the instance's transfer engines, started here when not given."""
    if args.role == "both":
        return None
    secret = load_secret(args.disagg_secret)
    if ranks is None:
        ranks = InstanceRanks(engine, args.kv_transfer_engine, args.kv_transfer_host, args.kv_transfer_protocol)
    if args.role == "prefill":
        service = PrefillService(engine, ranks, secret, args.disagg_park_timeout)
        app.include_router(service.router(render))
    else:
        service = DecodeHandoff(engine, ranks, secret, args.disagg_on_failure, args.disagg_local_prefill_tokens)
        app.state.server = dataclasses.replace(app.state.server, handoff=service)
        app.include_router(service.router(render))
        app.add_middleware(PrefillTarget, secret=secret)
    state = app.state.server
    state.metrics.registry.register(CounterCollector(service.counters, state.model_name))
    if args.role == "decode":
        state.metrics.registry.register(BypassCollector(service.bypasses, state.model_name))
    log.info(
        "role %s: transfer engine %s over %s at %s (%d rank%s)",
        args.role,
        args.kv_transfer_engine,
        args.kv_transfer_protocol,
        ", ".join(e.session for e in ranks.endpoints),
        ranks.world,
        "s" if ranks.world > 1 else "",
    )
    return service


async def render(state, path: str, body: dict) -> list[int] | None:
    """The prompt ids a generation request would get here (None where it has no single prompt or
    is refused: a match then counts nothing)."""
    try:
        if path == "/v1/chat/completions":
            ids, *_ = await chat_prompt_ids(ChatRequest.model_validate(body), state)
            return ids
        if path == "/v1/completions":
            prompt = CompletionRequest.model_validate(body).prompt
            if isinstance(prompt, str):
                return state.require_tokenizer().encode(prompt)
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
    except (ValidationError, APIError, ValueError):
        return None
    return None
