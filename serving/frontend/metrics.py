"""Prometheus metrics of one server, in its own CollectorRegistry (tests run several servers).

Every metric carries the labels model and revision. Request outcomes:
`pagedjax_request_outcomes_total{outcome, reason}` with outcome one of success, cancelled,
rejected, timed_out, failed, and reason e.g. queue_full / deadline / tenant_tokens /
invalid_argument for rejections, client / slow_consumer for cancellations.
Engine counters (preemptions, prefix cache and its host tier, steps, tokens processed) are
cumulative in the engine's stats(); the engine thread turns them into counter increments
with `observe_stats`.

Per request (successes): TTFT, TPOT, ITL, E2E, queue, prefill (first scheduled -> first
token) and decode (first token -> finish) time histograms, prompt and generation token
histograms; per finished request `pagedjax_request_finish_reasons_total{finish_reason}`. Per
engine step: generated tokens (`pagedjax_step_generated_tokens`), and for a mixture-of-experts
model the expert load (engine/runner/expert_load.py): `pagedjax_moe_expert_imbalance`, the
step's sum over sparse layers of the busiest expert's tokens / the mean expert's (1 =
balanced, E/k the ceiling), and `pagedjax_moe_expert_tokens_total{expert}`, real tokens
routed to expert e summed over the sparse layers. NOTE: labelled by expert only, not by
layer: E series (8-256 for today's MoE models) where layer x expert would be 6,144 for
Qwen3-30B-A3B; expert e of every layer lives on the same device under expert parallelism,
so the sum over layers is that device's load. Per-layer counts are in the engine's stats
(`moe_expert_tokens`, the notebook API's LLM.stats()). The cache configuration is an
info metric; the process (CPU, memory, file descriptors) and Python platform collectors are
registered on the same registry, so one scrape has everything. The Grafana dashboard in
deploy/grafana/pagedjax.json queries only these names (tests/test_dashboard.py checks).
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
# actual / predicted finish of an admitted request (the admission model's error)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# an MoE step's busiest / mean expert load (>= 1; E/k at one token: 4 for 8 experts top-2,
# 16 for 128 top-8, 32 for 256 top-8)
IMBALANCE_BUCKETS = (1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)
OUTCOMES = ("success", "cancelled", "rejected", "timed_out", "failed")

_STATS_COUNTERS = {  # engine stats key -> counter attribute
    "num_preemptions": "preemptions",
    "prefix_cache_queries_tokens": "prefix_queries",
    "prefix_cache_hit_tokens": "prefix_hits",
    "num_steps": "engine_steps",
    "tokens_processed": "tokens_processed",
    "compiles_total": "compiles",
    "compiles_after_warmup": "compiles_after_warmup",
    # the prefix cache's host tier (engine/sched/host_tier.py)
    "host_kv_hit_tokens": "host_kv_hits",
    "host_kv_saved_bytes": "host_kv_saved_bytes",
    "host_kv_loaded_bytes": "host_kv_loaded_bytes",
    "host_kv_load_s": "host_kv_load_seconds",
    # speculative decoding (engine/spec/decode.py)
    "spec_verify_steps": "spec_verify_steps",
    "spec_drafted_tokens": "spec_drafted",
    "spec_accepted_tokens": "spec_accepted",
}
# engine stats keys shown as labels of pagedjax_cache_config_info
CACHE_CONFIG_KEYS = (
    "page_size",
    "kv_pages_total",
    "kv_capacity_tokens",
    "kv_bytes_total",
    "max_num_seqs",
    "max_model_len",
    "prefix_cache_enabled",
    "host_kv_bytes_total",
)


class ServerMetrics:
    def __init__(self, model: str, revision: str, compat: str = "vllm"):
        """`compat`: "vllm" also exposes vLLM's names as aliases (serving/gateway/metrics_compat.py,
        the gateway's model-server protocol); "none": only the pagedjax_* families."""
        self.registry = prom.CollectorRegistry()
        self.labels = {"model": model, "revision": revision}
        names = ["model", "revision"]
        r = self.registry
        self.families: dict[str, prom.metrics.MetricWrapperBase] = {}  # name -> family
        self.cache_config_values: dict = {}

        def family(cls, name, doc, labelnames=names, **kwargs):
            self.families[name] = cls(name, doc, labelnames, registry=r, **kwargs)
            return self.families[name]

        def hist(name, doc, buckets=LATENCY_BUCKETS_S):
            return family(prom.Histogram, name, doc, buckets=buckets).labels(**self.labels)

        def gauge(name, doc):
            return family(prom.Gauge, name, doc).labels(**self.labels)

        def counter(name, doc):
            return family(prom.Counter, name, doc).labels(**self.labels)

        self.ttft = hist("pagedjax_time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist("pagedjax_inter_token_latency_seconds", "Gap between tokens", ITL_BUCKETS_S)
        self.tpot = hist(
            "pagedjax_time_per_output_token_seconds",
            "Mean gap after the first token",
            ITL_BUCKETS_S,
        )
        self.e2e = hist("pagedjax_e2e_request_latency_seconds", "Arrival to finish")
        self.queue = hist("pagedjax_queue_time_seconds", "Arrival to first scheduled")
        self.prefill = hist(
            "pagedjax_request_prefill_time_seconds", "First scheduled to first token"
        )
        self.decode = hist("pagedjax_request_decode_time_seconds", "First token to finish")
        self.request_prompt_tokens = hist(
            "pagedjax_request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "pagedjax_request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS
        )
        self.step_generated_tokens = hist(
            "pagedjax_step_generated_tokens", "Tokens generated by one engine step", TOKEN_BUCKETS
        )
        self.moe_imbalance = hist(
            "pagedjax_moe_expert_imbalance",
            "MoE step: sum over layers of the busiest expert's tokens / the mean expert's",
            IMBALANCE_BUCKETS,
        )
        self.moe_expert_tokens = family(
            prom.Counter,
            "pagedjax_moe_expert_tokens",
            "Real tokens routed to each expert, summed over the sparse layers",
            names + ["expert"],
        )
        self.finish_reasons = family(
            prom.Counter,
            "pagedjax_request_finish_reasons",
            "Requests the engine finished, by finish reason (stop, length, cancelled, ...)",
            names + ["finish_reason"],
        )
        self.engine_steps = counter("pagedjax_engine_steps", "Engine steps run")
        self.tokens_processed = counter(
            "pagedjax_engine_tokens_processed", "Prompt and decode tokens computed by the engine"
        )
        self.compiled_steps = gauge(
            "pagedjax_compiled_step_programs", "Step programs compiled so far (flat after warm-up)"
        )
        self.cache_config = prom.Info(
            "pagedjax_cache_config", "KV cache configuration of the engine", names, registry=r
        )
        prom.ProcessCollector(registry=r)  # process_cpu_seconds_total, _resident_memory_bytes
        prom.PlatformCollector(registry=r)  # python_info
        prom.GCCollector(registry=r)
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
        # The host tier: prompt tokens it served, bytes copied each way, host seconds spent
        # copying back, and its fill (pagedjax_cache_config_info has its size).
        self.host_kv_hits = counter(
            "pagedjax_host_kv_hits_tokens", "Prompt tokens served from the host KV tier"
        )
        self.host_kv_saved_bytes = counter(
            "pagedjax_host_kv_saved_bytes", "KV bytes copied from the device to the host tier"
        )
        self.host_kv_loaded_bytes = counter(
            "pagedjax_host_kv_loaded_bytes", "KV bytes copied from the host tier to the device"
        )
        self.host_kv_load_seconds = counter(
            "pagedjax_host_kv_load_seconds", "Host seconds spent copying host-tier pages back"
        )
        self.host_kv_bytes_used = gauge(
            "pagedjax_host_kv_bytes_used", "Bytes of KV pages held in the host tier"
        )
        # From the engine's stats (engine/runner/compiles.py): programs built in the process, and
        # those built after warm-up (each a stall of every running request; should stay 0).
        self.compiles = counter("pagedjax_compiles", "XLA programs compiled or loaded")
        self.compiles_after_warmup = counter(
            "pagedjax_compiles_after_warmup", "XLA programs built while serving"
        )
        self.spec_verify_steps = counter(
            "pagedjax_spec_verify_steps", "Engine steps that verified speculative drafts"
        )
        self.spec_drafted = counter("pagedjax_spec_drafted_tokens", "Draft tokens verified")
        self.spec_accepted = counter("pagedjax_spec_accepted_tokens", "Draft tokens accepted")
        self.generate_calls = counter(
            "pagedjax_generate_calls", "Generate calls that reached the server"
        )
        self.outcomes = prom.Counter(
            "pagedjax_request_outcomes",
            "Requests by how they ended",
            names + ["outcome", "reason"],
            registry=r,
        )
        # The admission model's error (serving/frontend/capacity_calibration.py): for each admitted
        # request that finished or timed out, actual / predicted time from admission to its
        # end (predicted for the tokens it produced).
        self.prediction_ratio = hist(
            "pagedjax_admission_finish_ratio",
            "Actual / predicted finish of admitted requests (1 = exact)",
            RATIO_BUCKETS,
        )
        self.predicted_finish = hist(
            "pagedjax_admission_predicted_finish_seconds",
            "Predicted seconds from admission to the end of admitted requests",
        )
        self.actual_finish = hist(
            "pagedjax_admission_actual_finish_seconds",
            "Actual seconds from admission to the end of admitted requests",
        )
        self._last_stats: dict[str, float] = {}
        self._last_moe_step: int | None = None  # the engine step last put in moe_imbalance
        self.compat = None
        if compat == "vllm":  # gateway model-server protocol (GIE, llm-d, KServe)
            from serving.gateway.metrics_compat import VllmCompatCollector

            config = lambda: self.cache_config_values  # noqa: E731 - read at scrape time
            self.compat = VllmCompatCollector(self.families, config, model)
            r.register(self.compat)
        elif compat != "none":
            raise ValueError(f"metrics_compat={compat!r} is invalid: one of vllm, none")

    def observe_prediction(self, predicted_s: float, actual_s: float) -> None:
        self.predicted_finish.observe(predicted_s)
        self.actual_finish.observe(actual_s)
        if predicted_s > 0:
            self.prediction_ratio.observe(actual_s / predicted_s)

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

    def set_cache_config(self, stats: dict) -> None:
        """pagedjax_cache_config_info{page_size=..., kv_pages_total=..., ...} 1"""
        info = {k: str(stats[k]) for k in CACHE_CONFIG_KEYS if k in stats}
        self.cache_config_values = info
        self.cache_config.labels(**self.labels).info(info)

    def observe_step(self, outputs, step_info: dict | None = None) -> None:
        """One engine step's outputs (RequestOutput deltas): tokens it generated; and from
        the engine's `last_step_info` (None: not available) an MoE step's expert imbalance."""
        self.step_generated_tokens.observe(sum(len(o.new_token_ids) for o in outputs))
        # NOTE: a step() call that processed no device step leaves last_step_info as it was:
        # each engine step (its "step" number) is observed once; 0.0: nothing was routed.
        info = step_info or {}
        if info.get("expert_imbalance") and info.get("step") != self._last_moe_step:
            self._last_moe_step = info.get("step")
            self.moe_imbalance.observe(info["expert_imbalance"])

    def observe_stats(self, stats: dict, num_queued: int) -> None:
        """Gauges from the engine's stats(); cumulative engine counters become increments."""
        if stats.get("num_compiled_steps") is not None:
            self.compiled_steps.set(stats["num_compiled_steps"])
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0) + num_queued)
        self.kv_pages_used.set(stats.get("kv_pages_used", 0))
        self.kv_pages_free.set(stats.get("kv_pages_free", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        self.host_kv_bytes_used.set(stats.get("host_kv_bytes_used", 0))
        for key, attr in _STATS_COUNTERS.items():
            now = float(stats.get(key) or 0)
            delta = now - self._last_stats.get(key, 0.0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_stats[key] = now
        by_expert = stats.get("moe_expert_tokens_by_expert") or []
        for expert, tokens in enumerate(by_expert):
            key = f"moe_expert_tokens/{expert}"
            delta = float(tokens) - self._last_stats.get(key, 0.0)
            if delta > 0:
                self.moe_expert_tokens.labels(**self.labels, expert=str(expert)).inc(delta)
            self._last_stats[key] = float(tokens)

    def record_finish_reason(self, finish_reason: str | None) -> None:
        if finish_reason:
            self.finish_reasons.labels(**self.labels, finish_reason=finish_reason).inc()

    def observe_finished(
        self,
        *,
        ttft_s,
        tpot_s,
        e2e_s,
        queue_s,
        itl_s,
        prompt_tokens: int | None = None,
        generation_tokens: int | None = None,
    ) -> None:
        """Histograms of a successful request (seconds, tokens; None: not measured)."""
        prefill_s = ttft_s - queue_s if ttft_s is not None and queue_s is not None else None
        decode_s = e2e_s - ttft_s if e2e_s is not None and ttft_s is not None else None
        for hist, value in (
            (self.ttft, ttft_s),
            (self.tpot, tpot_s),
            (self.e2e, e2e_s),
            (self.queue, queue_s),
            (self.prefill, prefill_s if prefill_s is None else max(prefill_s, 0.0)),
            (self.decode, decode_s),
            (self.request_prompt_tokens, prompt_tokens),
            (self.request_generation_tokens, generation_tokens),
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
