"""What both roles share: the authenticated msgpack route plumbing and the `/disagg/state` report."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from ..server.async_engine import AsyncEngine
from ..server.errors import APIError
from .protocol import MSGPACK, SECRET_HEADER, authorized, decode, encode


def check_secret(request: Request, secret: str) -> None:
    if not authorized(request.headers.get(SECRET_HEADER), secret):
        raise APIError(401, "this internal endpoint needs the instances' shared secret", "authentication_error")


async def read_msg(request: Request, secret: str, kind: type):
    check_secret(request, secret)
    try:
        return decode(await request.body(), kind)
    except Exception as e:
        raise APIError(400, f"malformed {kind.__name__}: {e}") from None


def reply(msg) -> Response:
    return Response(encode(msg), media_type=MSGPACK)


def pool_state(core, extra: dict) -> dict:
    """Pool usage and an integrity check, on the engine thread (leak checks in tests and ops)."""
    try:
        core.cache.check_integrity()
        integrity = "ok"
    except AssertionError as e:
        integrity = str(e)
    stats = core.cache.prefix_stats() if core.cache.prefix_enabled else {}
    return {
        **core.cache.usage(),
        "cached_pages": stats.get("cached_pages", 0),
        "checkpoint_slots_used": stats.get("checkpoint_slots_used", 0),
        "sequences_holding_cache": len(core.cache.seqs),
        "parked": len(core.parked),
        "computed_tokens": core.counters["computed_tokens"],
        "integrity": integrity,
        **extra,
    }


async def engine_state(engine: AsyncEngine, extra: dict) -> dict:
    return await engine.call(lambda core: pool_state(core, extra))


class CounterCollector:
    """Exports a role's counters on the instance's `/metrics` as `deltaserve:disagg_<name>_total`."""

    HELP = {
        "bytes_mla": "MLA latent bytes received by handoff from prefill instances (once per decode instance)",
        "bytes_mla_shared": "MLA latent bytes ranks 1.. copied from this instance's rank 0 after a handoff",
        "bytes_kda": "KDA state bytes (conv tails and recurrent states) received by handoff",
        "handoffs": "Handoffs verified and run",
        "forks": "Further samples (n > 1) that took a handoff's cache by copy on this instance",
        "image_handoffs": "Handoffs of prompts with images (the prefill instance encoded them)",
        "failures": "Handoffs refused (verification, peer or transfer failure)",
        "recomputes": "Refused handoffs recomputed locally",
        "hits": "Handoffs that started after pages this instance's prefix cache held",
        "hit_tokens": "Prompt tokens this instance's prefix cache held, not transferred",
        "transfer_us": "Microseconds spent in handoffs (prefill wait, read, verification)",
        "read_us": "Microseconds spent reading handoff bytes from prefill instances",
        "local_prefills": "Requests this decode instance prefilled itself (its joint hit left little to compute)",
        "reserve_waits": "Handoffs that waited on the engine thread for a free slot or pages",
        "prefills": "Prompts computed for decode instances",
        "prefill_tokens": "Tokens computed for decode instances",
        "offered_bytes": "Bytes offered to decode instances",
        "expired": "Computed prompts freed unread at the park timeout",
    }

    def __init__(self, counters, model_name: str):
        self.counters, self.model_name = counters, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for key, value in sorted(self.counters.items()):
            m = CounterMetricFamily(f"deltaserve:disagg_{key}", self.HELP.get(key, key), labels=["model_name"])
            m.add_metric([self.model_name], value)
            yield m


BYPASS_REASONS = (
    "no_prefill_target",
    "images",
    "short_prompt",
    "invalid",
    "local_prefill",
    "reserve_timeout",
    "handoff_failed",
)


class BypassCollector:
    """Exports a decode instance's bypasses (`DecodeHandoff.bypasses`: requests it computed itself
    instead of taking their prompt by handoff) as `deltaserve:pd_bypass_total{reason}`, every known
    reason from zero."""

    HELP = "Requests this decode instance computed itself instead of taking the prompt by handoff, by reason"

    def __init__(self, bypasses, model_name: str):
        self.bypasses, self.model_name = bypasses, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        m = CounterMetricFamily("deltaserve:pd_bypass", self.HELP, labels=["model_name", "reason"])
        for reason in dict.fromkeys([*BYPASS_REASONS, *sorted(self.bypasses)]):
            m.add_metric([self.model_name, reason], self.bypasses.get(reason, 0))
        yield m
