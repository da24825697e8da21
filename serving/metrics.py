"""Prometheus metrics of one server, in its own CollectorRegistry (tests run several servers).

Every metric carries the labels model and revision. Request outcomes:
`pagedjax_request_outcomes_total{outcome, reason}` with outcome one of success, cancelled,
rejected, timed_out, failed, and reason e.g. queue_full / deadline / tenant_tokens /
invalid_argument for rejections, client / slow_consumer for cancellations.
Engine counters (preemptions, prefix cache) are cumulative in the engine's stats(); the
engine thread turns them into counter increments with `observe_stats`.
"""

from __future__ import annotations

import prometheus_client as prom

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
ITL_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.5,
    5.0,
)
OUTCOMES = ("success", "cancelled", "rejected", "timed_out", "failed")

_STATS_COUNTERS = {  # engine stats key -> counter attribute
    "num_preemptions": "preemptions",
    "prefix_cache_queries_tokens": "prefix_queries",
    "prefix_cache_hit_tokens": "prefix_hits",
    "compiles_total": "compiles",
    "compiles_after_warmup": "compiles_after_warmup",
}


class ServerMetrics:
    def __init__(self, model: str, revision: str):
        self.registry = prom.CollectorRegistry()
        self.labels = {"model": model, "revision": revision}
        names = ["model", "revision"]
        r = self.registry

        def hist(name, doc, buckets=LATENCY_BUCKETS_S):
            return prom.Histogram(name, doc, names, buckets=buckets, registry=r).labels(
                **self.labels
            )

        def gauge(name, doc):
            return prom.Gauge(name, doc, names, registry=r).labels(**self.labels)

        def counter(name, doc):
            return prom.Counter(name, doc, names, registry=r).labels(**self.labels)

        self.ttft = hist("pagedjax_time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist("pagedjax_inter_token_latency_seconds", "Gap between tokens", ITL_BUCKETS_S)
        self.tpot = hist(
            "pagedjax_time_per_output_token_seconds",
            "Mean gap after the first token",
            ITL_BUCKETS_S,
        )
        self.e2e = hist("pagedjax_e2e_request_latency_seconds", "Arrival to finish")
        self.queue = hist("pagedjax_queue_time_seconds", "Arrival to first scheduled")
        self.running = gauge("pagedjax_num_requests_running", "Requests running in the engine")
        self.waiting = gauge(
            "pagedjax_num_requests_waiting", "Requests waiting (server queue + engine waiting)"
        )
        self.kv_pages_used = gauge("pagedjax_kv_pages_used", "KV cache pages in use")
        self.kv_pages_free = gauge("pagedjax_kv_pages_free", "KV cache pages free")
        self.kv_usage = gauge("pagedjax_kv_usage_ratio", "Fraction of KV pages in use")
        self.prompt_tokens = counter("pagedjax_prompt_tokens", "Prompt tokens handed to the engine")
        self.generated_tokens = counter("pagedjax_generation_tokens", "Generated tokens")
        self.preemptions = counter("pagedjax_preemptions", "Requests preempted by the engine")
        self.prefix_queries = counter(
            "pagedjax_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter(
            "pagedjax_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache"
        )
        # From the engine's stats (engine/compiles.py): programs built in the process, and
        # those built after warm-up (each a stall of every running request; should stay 0).
        self.compiles = counter("pagedjax_compiles", "XLA programs compiled or loaded")
        self.compiles_after_warmup = counter(
            "pagedjax_compiles_after_warmup", "XLA programs built while serving"
        )
        self.generate_calls = counter(
            "pagedjax_generate_calls", "Generate calls that reached the server"
        )
        self.outcomes = prom.Counter(
            "pagedjax_request_outcomes",
            "Requests by how they ended",
            names + ["outcome", "reason"],
            registry=r,
        )
        self._last_stats: dict[str, float] = {}

    def record_outcome(self, outcome: str, reason: str = "") -> None:
        assert outcome in OUTCOMES, outcome
        self.outcomes.labels(**self.labels, outcome=outcome, reason=reason).inc()

    def outcome_count(self, outcome: str | None = None) -> float:
        """Sum of the outcome counter (all outcomes, or one); for tests and reports."""
        total = 0.0
        for metric in self.outcomes.collect():
            for s in metric.samples:
                if s.name.endswith("_total") and outcome in (None, s.labels["outcome"]):
                    total += s.value
        return total

    def observe_stats(self, stats: dict, num_queued: int) -> None:
        """Gauges from the engine's stats(); cumulative engine counters become increments."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0) + num_queued)
        self.kv_pages_used.set(stats.get("kv_pages_used", 0))
        self.kv_pages_free.set(stats.get("kv_pages_free", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        for key, attr in _STATS_COUNTERS.items():
            now = float(stats.get(key) or 0)
            delta = now - self._last_stats.get(key, 0.0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_stats[key] = now

    def observe_finished(self, *, ttft_s, tpot_s, e2e_s, queue_s, itl_s) -> None:
        """Latency histograms of a successful request (seconds; None: not measured)."""
        for hist, value in (
            (self.ttft, ttft_s),
            (self.tpot, tpot_s),
            (self.e2e, e2e_s),
            (self.queue, queue_s),
        ):
            if value is not None:
                hist.observe(value)
        for gap in itl_s:
            self.itl.observe(gap)

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)


def start_metrics_http(metrics: ServerMetrics, port: int):
    """Serve /metrics on `port` (0: ephemeral). Returns the HTTP server (`.server_port`)."""
    server, _thread = prom.start_http_server(port, registry=metrics.registry)
    return server
