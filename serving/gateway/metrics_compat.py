"""vLLM's metric names over our own: the Gateway API Inference Extension's model-server
protocol, and the series existing vLLM dashboards and alerts query.

The endpoint picker (EPP) of the Gateway API Inference Extension / llm-d scrapes each pod
and reads, by default, vLLM's names:

    vllm:num_requests_waiting       gauge   requests queued (server queue + engine waiting)
    vllm:num_requests_running       gauge   requests in the running batch
    vllm:kv_cache_usage_perc        gauge   used KV pages / total KV pages (a 0-1 fraction)
    vllm:cache_config_info          gauge 1 {block_size, num_gpu_blocks}
    vllm:lora_requests_info         gauge   {max_lora, running_lora_adapters,
                                             waiting_lora_adapters}; value = the unix time
                                             of its last update (the EPP keeps the newest)

and the latency histograms and token counters under vLLM's names:
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`,
`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total{finished_reason}`, `vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total` (the prefix-cache counters count tokens, as vLLM's do).

Every one of them is an ALIAS: `VllmCompatCollector.collect` re-labels, at scrape time, the
samples of a `pagedjax_*` family the server already keeps (serving/frontend/metrics.py), so the two
name sets cannot disagree and the hot path pays nothing for the second set. Labels are
vLLM's (`model_name`, `engine`) instead of ours (`model`, `revision`). Histogram buckets are
ours (PromQL's histogram_quantile does not care). `--metrics_compat=none` registers none
of these. Our finish reasons map onto vLLM's: stop, length, abort (cancelled, timed out)
and error (failed, rejected, no route).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

COMPAT_MODES = ("vllm", "none")

# vLLM name (without _total) -> our family name (without _total)
ALIASES = {
    "vllm:num_requests_waiting": "pagedjax_num_requests_waiting",
    "vllm:num_requests_running": "pagedjax_num_requests_running",
    "vllm:kv_cache_usage_perc": "pagedjax_kv_usage_ratio",
    "vllm:time_to_first_token_seconds": "pagedjax_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "pagedjax_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "pagedjax_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "pagedjax_queue_time_seconds",
    "vllm:prompt_tokens": "pagedjax_prompt_tokens",
    "vllm:generation_tokens": "pagedjax_generation_tokens",
    "vllm:request_success": "pagedjax_request_finish_reasons",
    "vllm:prefix_cache_queries": "pagedjax_prefix_cache_queries_tokens",
    "vllm:prefix_cache_hits": "pagedjax_prefix_cache_hits_tokens",
}
# our finish_reason -> vLLM's finished_reason (vllm.v1.engine.FinishReason)
FINISHED_REASONS = {
    "stop": "stop",
    "length": "length",
    "cancelled": "abort",
    "timed_out": "abort",
    "failed": "error",
    "rejected": "error",
    "unavailable": "error",
}
ENGINE_INDEX = "0"  # vLLM's `engine` label: one engine core per server here


class LoraState:
    """What vllm:lora_requests_info reports: slots, and the adapters of running and waiting
    requests (names, sorted)."""

    def __init__(self, max_lora: int, running: list[str], waiting: list[str]):
        self.max_lora, self.running, self.waiting = max_lora, running, waiting


class VllmCompatCollector(Collector):
    """Registered on the server's CollectorRegistry beside the pagedjax_* families.

    `families`: our family objects by name (ServerMetrics.families). `lora_state()`: None
    when the engine serves no LoRA (then no vllm:lora_requests_info, as vLLM)."""

    def __init__(
        self,
        families: dict,
        cache_config: Callable[[], dict],
        model_name: str,
        lora_state: Callable[[], LoraState | None] = lambda: None,
    ):
        self.families = families
        self.cache_config = cache_config
        self.labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        self.lora_state = lora_state

    def describe(self) -> list:
        return []  # registered without a name check (names are ours only at scrape time)

    def collect(self) -> Iterator[Metric]:
        for name, source in ALIASES.items():
            family = self.families.get(source)
            if family is not None:
                yield from self._alias(name, source, family)
        config = self.cache_config()
        if "page_size" in config and "kv_pages_total" in config:
            info = Metric("vllm:cache_config_info", "KV cache configuration", "gauge")
            info.add_sample(
                "vllm:cache_config_info",
                {
                    **self.labels,
                    "block_size": str(config["page_size"]),
                    "num_gpu_blocks": str(config["kv_pages_total"]),
                },
                1.0,
            )
            yield info
        lora = self.lora_state()
        if lora is not None:
            yield _lora_info(lora)

    def _alias(self, name: str, source: str, family) -> Iterator[Metric]:
        for metric in family.collect():
            out = Metric(name, metric.documentation, metric.type)
            for s in metric.samples:
                labels = {**self.labels}
                reason = s.labels.get("finish_reason")
                if reason is not None:
                    labels["finished_reason"] = FINISHED_REASONS.get(reason, "error")
                extra = {k: v for k, v in s.labels.items() if k not in _OURS}
                labels.update(extra)
                out.add_sample(name + s.name[len(source) :], labels, s.value, s.timestamp)
            if reason_mapped(source):
                out.samples = _summed(out.samples)
            yield out


_OURS = ("model", "revision", "finish_reason")


def reason_mapped(source: str) -> bool:
    """Whether several of our label values fold into one of vLLM's (then samples add up)."""
    return source == "pagedjax_request_finish_reasons"


def _summed(samples: list) -> list:
    """Samples with equal name and labels added up (our cancelled + timed_out -> abort);
    `_created` keeps the earliest."""
    out: dict = {}
    for s in samples:
        key = (s.name, tuple(sorted(s.labels.items())))
        if key not in out:
            out[key] = s
        elif s.name.endswith("_created"):
            out[key] = out[key]._replace(value=min(out[key].value, s.value))
        else:
            out[key] = out[key]._replace(value=out[key].value + s.value)
    return list(out.values())


def _lora_info(lora: LoraState) -> Metric:
    info = Metric("vllm:lora_requests_info", "Running stats on lora requests.", "gauge")
    info.add_sample(
        "vllm:lora_requests_info",
        {
            "max_lora": str(lora.max_lora),
            "running_lora_adapters": ",".join(lora.running),
            "waiting_lora_adapters": ",".join(lora.waiting),
        },
        time.time(),
    )
    return info


def lora_state_of(loop) -> LoraState | None:
    """The adapters of the requests an EngineLoop holds: in the engine (running) or still in
    the server's queue (waiting). None when its engine has no LoRA slots.

    NOTE: a request the engine holds but has not scheduled yet counts as running here (the
    engine's waiting list is not visible to the serving layer, and the EPP only asks which
    adapters a pod is already serving)."""
    max_lora = loop.last_stats.get("lora_slots")
    if not max_lora:
        return None
    running, waiting = set(), set()
    for r in loop.active_requests():
        adapter = r.engine_request.adapter
        if adapter is None or r.outcome is not None:
            continue
        (waiting if r.added_s is None else running).add(adapter)
    return LoraState(int(max_lora), sorted(running), sorted(waiting))
