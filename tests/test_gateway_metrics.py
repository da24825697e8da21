"""The model-server protocol metrics (serving/gateway/metrics_compat.py) scraped from a running
server under load, parsed with prometheus_client's own text parser: every vLLM name the
gateway's endpoint picker and vLLM dashboards read is present with the right type, labels
and range; vllm:kv_cache_usage_perc equals used / total pages at that moment; LoRA info lists
a loaded adapter while a request uses it; --metrics_compat=none drops them all."""

from __future__ import annotations

import concurrent.futures
import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.gateway.metrics_compat import ALIASES
from serving.testing import running_server, wait_for

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)
COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def only_sample(family, name: str | None = None):
    samples = [s for s in family.samples if s.name == (name or family.name)]
    assert len(samples) == 1, samples
    return samples[0]


def scrape_on_engine_thread(server) -> tuple[dict, dict]:
    """(engine stats, parsed /metrics) at one moment: on the engine thread, between two
    steps, the gauges refreshed from the engine's stats as the loop does every 0.1 s."""

    def at_once(engine):
        stats = dict(engine.stats())
        stats["server_queue"] = len(server.waiting)
        server.metrics.observe_stats(stats, stats["server_queue"])
        return stats, server.metrics.exposition().decode()

    stats, text = server.loop.run_on_engine_thread(at_once).result(timeout=30)
    return stats, families(text)


def test_protocol_metrics_under_load():
    engine = MockEngine(step_time_s=0.01, num_pages=256, page_size=4)
    admission = AdmissionConfig(max_model_len=512)
    with running_server(engine, admission=admission, http_port=0, max_inflight=4) as (
        server,
        client,
    ):
        prompts = [f"shared system prompt, question {i % 3}: " + "word " * 20 for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(client.generate, p, max_tokens=100) for p in prompts]
            wait_for(lambda: server.loop.num_active() >= 8, what="requests queued and running")
            stats, fams = scrape_on_engine_thread(server)
            results = [f.result(timeout=60) for f in futures]
        assert all(r.ok for r in results), [r.details for r in results if not r.ok]

        # gauges: the engine's numbers at that moment
        assert stats["kv_pages_used"] > 0 and stats["num_running"] > 0
        for name in GAUGES:
            assert fams[name].type == "gauge", name
            sample = only_sample(fams[name])
            assert sample.labels == {"model_name": "mock", "engine": "0"}
        kv = only_sample(fams["vllm:kv_cache_usage_perc"]).value
        assert kv == stats["kv_pages_used"] / stats["kv_pages_total"] and 0 < kv <= 1
        running = only_sample(fams["vllm:num_requests_running"]).value
        assert running == stats["num_running"] and 1 <= running <= 4
        waiting = only_sample(fams["vllm:num_requests_waiting"]).value
        assert waiting == stats["num_waiting"] + stats["server_queue"]
        info = only_sample(fams["vllm:cache_config_info"])
        assert fams["vllm:cache_config_info"].type == "gauge" and info.value == 1
        assert info.labels["block_size"] == "4"
        assert info.labels["num_gpu_blocks"] == str(stats["kv_pages_total"]) == "255"
        assert "vllm:lora_requests_info" not in fams  # the mock serves no LoRA (as vLLM)

        # the same text over HTTP /metrics, after the load: histograms and counters
        wait_for(lambda: server.metrics.outcome_count("success") == 12, what="12 successes")
        text = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10).text
        fams = families(text)
        for name in HISTOGRAMS:
            assert fams[name].type == "histogram", name
            buckets = [s for s in fams[name].samples if s.name == name + "_bucket"]
            assert [b.labels["le"] for b in buckets][-1] == "+Inf"
            counts = [b.value for b in buckets]
            assert counts == sorted(counts), f"{name}: buckets not cumulative"
            assert only_sample(fams[name], name + "_count").value == counts[-1] > 0
            assert only_sample(fams[name], name + "_sum").value >= 0
        assert only_sample(fams[HISTOGRAMS[0]], HISTOGRAMS[0] + "_count").value == 12
        for name in COUNTERS:
            assert fams[name].type == "counter", name
        success = [s for s in fams["vllm:request_success"].samples if s.name.endswith("_total")]
        assert {s.labels["finished_reason"]: s.value for s in success} == {"length": 12}
        generated = only_sample(fams["vllm:generation_tokens"], "vllm:generation_tokens_total")
        assert generated.value == 12 * 100
        prompt = only_sample(fams["vllm:prompt_tokens"], "vllm:prompt_tokens_total").value
        ours = only_sample(fams["pagedjax_prompt_tokens"], "pagedjax_prompt_tokens_total").value
        assert prompt == ours > 0
        hits = only_sample(fams["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total").value
        queries = fams["vllm:prefix_cache_queries"]
        assert 0 < hits <= only_sample(queries, "vllm:prefix_cache_queries_total").value
        # every alias present, our own families kept
        assert set(ALIASES) <= set(fams)
        assert "pagedjax_kv_usage_ratio" in fams and "pagedjax_num_requests_running" in fams


def test_finish_reasons_fold_into_vllms():
    with running_server(MockEngine(step_time_s=0.002)) as (server, _):
        for reason, count in (("stop", 2), ("length", 3), ("cancelled", 1), ("timed_out", 4)):
            for _ in range(count):
                server.metrics.record_finish_reason(reason)
        server.metrics.record_finish_reason("failed")
        fam = families(server.metrics.exposition().decode())["vllm:request_success"]
    totals = {s.labels["finished_reason"]: s.value for s in fam.samples if s.name[-6:] == "_total"}
    assert totals == {"stop": 2, "length": 3, "abort": 5, "error": 1}


def test_metrics_compat_none_drops_every_vllm_name():
    with running_server(MockEngine(step_time_s=0.002), metrics_compat="none") as (server, client):
        assert client.generate("hello", max_tokens=3).ok
        names = families(server.metrics.exposition().decode())
    assert not [n for n in names if n.startswith("vllm:")]
    assert "pagedjax_kv_usage_ratio" in names


def test_bad_metrics_compat_is_a_clear_error():
    from serving.frontend.metrics import ServerMetrics

    with pytest.raises(ValueError, match="metrics_compat='sglang' is invalid: one of vllm, none"):
        ServerMetrics("m", "r", "sglang")


@pytest.mark.compile
def test_lora_info_lists_the_adapter_a_request_uses(tiny_model, tmp_path):
    from configs.engine_config import EngineConfig
    from engine.core import EngineCore
    from models.lora_random import write_peft_adapter

    config = EngineConfig(
        model="tiny",
        page_size=4,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        max_model_len=128,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = EngineCore(tiny_model, config)
    engine.load_adapter("a1", write_peft_adapter(tmp_path / "a1", tiny_model.config, scale=0.3))
    seen = []

    def lora_info():
        fams = families(server.metrics.exposition().decode())
        sample = only_sample(fams["vllm:lora_requests_info"])
        seen.append(sample)
        return sample.labels["running_lora_adapters"] == "a1"

    admission = AdmissionConfig(max_model_len=128)
    with (
        running_server(engine, admission=admission) as (server, client),
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        # gRPC `model` naming the adapter selects it (the protocol's LoRA rule)
        future = pool.submit(client.generate, "hello world", max_tokens=100, model="a1")
        wait_for(lora_info, timeout_s=60, what=lambda: f"a1 running; seen {seen[-1:]}")
        assert future.result(timeout=120).versions["adapter"] == "a1"
    last = seen[-1]
    assert last.labels["max_lora"] == "2" and last.labels["waiting_lora_adapters"] == ""
    assert math.isfinite(last.value) and last.value > 1.7e9  # a unix timestamp
