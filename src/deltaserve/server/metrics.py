"""Prometheus metrics for the server: a per-app `CollectorRegistry` with `deltaserve:` names
shaped like vLLM's (`vllm:` -> `deltaserve:`).

Request-side numbers (finish reasons, tokens, TTFT / inter-token / end-to-end latency) are
recorded on the event loop from each request's delta stream. Engine-side numbers (queue sizes,
MLA pages, KDA slots, prefix-cache counters, the op backends' kernel fallbacks) come from a
`stats()` snapshot taken on the engine thread through `AsyncEngine.call` when `/metrics` is
scraped; the event loop never touches the `EngineCore`. If the engine does not answer, the last
snapshot is served.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

P = "deltaserve:"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)

# stats()["prefix_cache"] key -> (metric name without prefix, help); all cumulative counters
PREFIX_COUNTERS = {
    "queries": ("prefix_cache_queries", "Prefix-cache lookups (one per admitted sequence)"),
    "hits": ("prefix_cache_hits", "Prefix-cache lookups that reused cached state"),
    "hit_tokens": ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    "retention_misses": ("prefix_cache_retention_misses", "Prefix matches lost because the KDA checkpoint was evicted"),
    "checkpoints_stored": ("prefix_cache_checkpoints_stored", "KDA state checkpoints stored"),
    "checkpoints_evicted": ("prefix_cache_checkpoints_evicted", "KDA state checkpoints evicted"),
    "restore_refused": (
        "prefix_cache_restore_refused",
        "KDA checkpoints refused at restore: their tag did not match (treated as misses)",
    ),
    "inflight_waits": (
        "prefix_cache_inflight_waits",
        "Scheduling steps a request was held while an older one prefilled the prefix they share",
    ),
}
# stats() key -> (gauge name without prefix, help)
ENGINE_GAUGES = {
    "num_running": ("num_requests_running", "Sequences running in the engine"),
    "num_waiting": ("num_requests_waiting", "Sequences waiting to be scheduled"),
    "mla_pages_used": ("mla_pages_used", "MLA KV-cache pages in use"),
    "mla_pages_total": ("mla_pages_total", "MLA KV-cache pages in the pool"),
    "kda_slots_used": ("kda_slots_used", "KDA recurrent-state slots in use"),
    "kda_slots_total": ("kda_slots_total", "KDA recurrent-state slots in the pool"),
}
# stats() key -> (metric name without prefix, help): the image encoder cache (engine/exec/encoder_cache.py)
ENCODER_COUNTERS = {
    "encoder_cache_hits": ("encoder_cache_hits", "Images whose projector rows came from the encoder cache"),
    "encoder_cache_misses": ("encoder_cache_misses", "Images the vision tower encoded"),
    "encoder_cache_evictions": ("encoder_cache_evictions", "Images evicted from the encoder cache"),
}
ENCODER_GAUGES = {
    "encoder_cache_bytes": ("encoder_cache_bytes", "Bytes of projector rows in the encoder cache"),
    "encoder_cache_entries": ("encoder_cache_entries", "Images in the encoder cache"),
}
# stats() key -> (metric name without prefix, help): wide expert parallelism (engine/core/lockstep.py)
EP_COUNTERS = {
    "ep_rounds": ("ep_rounds", "Lock-step rounds (one forward on every wide-EP replica) this replica took part in"),
    "idle_forwards": ("ep_idle_forwards", "Zero-token forwards this replica ran to keep busy peers in step"),
}
EXPERT_HELP = (
    "Tokens each routed expert held by this replica ran, summed over the MoE layers (wide expert "
    "parallelism); over ep_rounds_total: tokens per expert per step"
)
FALLBACK_HELP = (
    "Op calls whose backend kernel did not run (the PyTorch reference or the layer's module path ran), "
    "by op and reason; this process's (rank 0's under tensor parallelism)"
)
PREFIX_GAUGES = {
    "checkpoint_slots_used": ("prefix_cache_checkpoint_slots_used", "KDA checkpoint slots in use"),
    "checkpoint_slots_total": ("prefix_cache_checkpoint_slots_total", "KDA checkpoint slots in the pool"),
}

# stats()["prefix_cache"]["tiers"][tier] key -> (metric name without prefix, help), labelled by tier
TIER_COUNTERS = {
    "hits": ("prefix_cache_tier_hits", "Prefix restores whose KDA checkpoint came from this tier"),
    "hit_tokens": ("prefix_cache_tier_hit_tokens", "Prompt tokens restored from this tier beyond the device hit"),
    "bytes_read": ("prefix_cache_tier_bytes_read", "Bytes of tier objects read from this tier"),
    "bytes_written": ("prefix_cache_tier_bytes_written", "Bytes of tier objects written to this tier"),
    "evicted": ("prefix_cache_tier_evictions", "Tier objects this tier evicted (its LRU and size limit)"),
    "writes_dropped": ("prefix_cache_tier_writes_dropped", "Objects not written: too many bytes were queued"),
}
TIER_GAUGES = {
    "objects": ("prefix_cache_tier_objects", "Tier objects held by this tier"),
    "bytes_used": ("prefix_cache_tier_bytes_used", "Bytes held by this tier"),
    "bytes_limit": ("prefix_cache_tier_bytes_limit", "Bytes this tier may hold"),
}


def tier_metrics(tiers: dict, model: str, hits: int):
    """Per-tier families from the tier store's stats: counters, gauges, the restore latency (a
    summary: count = hits, sum = seconds) and verification misses by reason (never restored).
    `hits` (all prefix hits) gives the device's share of the hits: those no tier lengthened."""
    names = [t for t, v in sorted(tiers.items()) if isinstance(v, dict)]
    for family, table in ((CounterMetricFamily, TIER_COUNTERS), (GaugeMetricFamily, TIER_GAUGES)):
        for key, (name, doc) in table.items():
            m = family(P + name, doc, labels=["model_name", "tier"])
            if key == "hits":
                m.add_metric([model, "device"], hits - sum(tiers[t].get("hits", 0) for t in names))
            for t in names:
                m.add_metric([model, t], tiers[t].get(key, 0))
            yield m
    lat = SummaryMetricFamily(
        P + "prefix_cache_tier_restore_seconds",
        "Time to restore a prefix from this tier",
        labels=["model_name", "tier"],
    )
    miss = CounterMetricFamily(
        P + "prefix_cache_tier_verify_misses",
        "Tier objects refused (torn, digest, fingerprint, manifest, missing, unreadable): counted misses, "
        "never restored",
        labels=["model_name", "tier", "reason"],
    )
    for t in names:
        lat.add_metric([model, t], tiers[t].get("hits", 0), tiers[t].get("restore_seconds", 0.0))
        for key, n in sorted(tiers[t].items()):
            if key.startswith("verify_miss_"):
                miss.add_metric([model, t, key.removeprefix("verify_miss_")], n)
    yield lat
    yield miss


# stats()["spec_decode"] key -> (metric name without prefix, help): speculative decoding (engine/spec)
SPEC_COUNTERS = {
    "drafts": ("spec_decode_num_drafts", "Sequence-steps that verified at least one draft token"),
    "draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified"),
    "accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
}
SPEC_GAUGES = {
    "mean_accepted_length": ("spec_decode_mean_accepted_length", "Mean tokens a drafted sequence-step yields"),
    "acceptance_rate": ("spec_decode_acceptance_rate", "Accepted over drafted tokens"),
}


class _EngineCollector:
    """Yields gauges and counters from the latest engine `stats()` snapshot."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict | None = None

    def collect(self):
        s = self.snapshot
        if not s:
            return
        pc = s.get("prefix_cache") or {}
        sd = s.get("spec_decode") or {}
        for family, table, values in (
            (CounterMetricFamily, SPEC_COUNTERS, sd),
            (GaugeMetricFamily, SPEC_GAUGES, sd),
            (GaugeMetricFamily, ENGINE_GAUGES, s),
            (CounterMetricFamily, ENCODER_COUNTERS, s),
            (GaugeMetricFamily, ENCODER_GAUGES, s),
            (CounterMetricFamily, PREFIX_COUNTERS, pc),
            (GaugeMetricFamily, PREFIX_GAUGES, pc),
            (CounterMetricFamily, EP_COUNTERS, s),
        ):
            for key, (name, doc) in table.items():
                if key in values:
                    m = family(P + name, doc, labels=["model_name"])
                    m.add_metric([self.model_name], values[key])
                    yield m
        if pc.get("tiers"):
            yield from tier_metrics(pc["tiers"], self.model_name, pc.get("hits", 0))
        if sd:
            yield self._by_position(sd)
        if "kernel_fallbacks" in s:
            yield self._fallbacks(s["kernel_fallbacks"])
        if "expert_load" in s:
            yield self._expert_load(s["expert_load"])

    def _expert_load(self, load: dict) -> CounterMetricFamily:
        """`expert_tokens_total{expert}` from stats()'s {"first", "tokens"} (this replica's experts)."""
        m = CounterMetricFamily(P + "expert_tokens", EXPERT_HELP, labels=["model_name", "expert"])
        for i, n in enumerate(load["tokens"]):
            m.add_metric([self.model_name, str(load["first"] + i)], n)
        return m

    def _by_position(self, sd: dict) -> CounterMetricFamily:
        """`spec_decode_num_accepted_tokens_per_pos_total{position}` (and drafted, by position)."""
        m = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft)",
            labels=["model_name", "position", "kind"],
        )
        for kind, key in (("accepted", "accepted_by_position"), ("drafted", "drafted_by_position")):
            for j, n in enumerate(sd[key]):
                m.add_metric([self.model_name, str(j), kind], n)
        return m

    def _fallbacks(self, table: dict) -> CounterMetricFamily:
        """`kernel_fallbacks_total{op, reason}` from stats()'s {op: {reason: calls}} (`ops.fallbacks`)."""
        m = CounterMetricFamily(P + "kernel_fallbacks", FALLBACK_HELP, labels=["model_name", "op", "reason"])
        for op, reasons in sorted(table.items()):
            for reason, n in sorted(reasons.items()):
                m.add_metric([self.model_name, op, reason], n)
        return m


class RequestTracker:
    """Observes one request's deltas (called by `RequestStream`); records into `Metrics`."""

    def __init__(self, metrics: "Metrics", n: int):
        self.m, self.start = metrics, time.monotonic()
        self.last: list[float | None] = [None] * n
        self.open = n

    def on_delta(self, d) -> None:
        now, i, k = time.monotonic(), d.index, len(d.token_ids)
        m = self.m
        if k:
            m.generation_tokens.inc(k)
            prev = self.last[i]
            if prev is None:
                m.ttft.observe(now - self.start)
                k -= 1
                prev = now
            if k > 0:  # tokens that arrived together share the gap since the previous delta
                gap = (now - prev) / k
                for _ in range(k):
                    m.tpot.observe(gap)
            self.last[i] = now
        if d.finish_reason is not None:
            self._finish(d.finish_reason)

    def aborted(self) -> None:
        while self.open > 0:
            self._finish("abort")

    def _finish(self, reason: str) -> None:
        if self.open <= 0:
            return
        self.open -= 1
        self.m._success.labels(self.m.model_name, reason).inc()
        self.m.e2e.observe(time.monotonic() - self.start)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = reg = CollectorRegistry()
        lab = {"labelnames": ["model_name"]}
        self.model_name = model_name
        self._success = Counter(
            P + "request_success",
            "Finished sequences by finish reason",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prompt tokens of admitted requests", registry=reg, **lab
        ).labels(model_name)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=reg, **lab).labels(
            model_name
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=reg, **lab
        ).labels(model_name)
        self.tpot = Histogram(
            P + "time_per_output_token_seconds", "Inter-token latency", buckets=TPOT_BUCKETS, registry=reg, **lab
        ).labels(model_name)
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "End-to-end sequence latency", buckets=E2E_BUCKETS, registry=reg, **lab
        ).labels(model_name)
        self.rejected = Counter(
            P + "request_rejected", "Requests refused because the waiting queue was full", registry=reg, **lab
        ).labels(model_name)
        self.reasoning_omitted = Counter(
            P + "k3_history_reasoning_omitted",
            "K3 chat requests with thinking on whose history has an assistant turn without its "
            "reasoning_content (preserved thinking lost: served as given)",
            registry=reg,
            **lab,
        ).labels(model_name)
        self.engine = _EngineCollector(model_name)
        reg.register(self.engine)

    def track(self, prompt_len: int, n: int) -> RequestTracker:
        self.prompt_tokens.inc(prompt_len)
        return RequestTracker(self, n)

    async def render(self, engine) -> tuple[bytes, str]:
        try:
            self.engine.snapshot = await engine.call(lambda core: core.stats(), timeout=5.0)
        except Exception:
            pass  # serve the last snapshot (or none) rather than fail the scrape
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
