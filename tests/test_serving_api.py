"""The request contract end to end: a real gRPC server on localhost with the MockEngine."""

import json
import subprocess
import sys
import urllib.request

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serving.client import GenerateClient, build_request
from serving.engine_host.mock_engine import MockEngine, MockIdentity, expected_continuation
from serving.frontend.admission import AdmissionConfig
from serving.frontend.tenants import TenantRegistry
from serving.proto import pagedjax_pb2 as pb
from serving.testing import outcome_counts, running_server, wait_for

ADMISSION = AdmissionConfig(
    max_prompt_tokens=100, max_tokens=64, max_model_len=128, max_stop_strings=2
)


@pytest.fixture(scope="module")
def served():
    engine = MockEngine(page_size=4, num_pages=64, step_time_s=0.001)
    with running_server(engine, admission=ADMISSION, metrics_port=0) as (server, client):
        yield server, client


def test_streaming_text_equals_mock_output(served):
    _, client = served
    res = client.generate("abc", max_tokens=12, stream=True, request_id="s1")
    assert res.ok, res.details
    assert res.text == "defghijklmno"
    assert res.token_ids == expected_continuation(ord("c"), 12)
    assert (res.finish_reason, res.prompt_tokens, res.completion_tokens) == ("length", 3, 12)
    assert res.request_id == "s1"
    assert len(res.token_times_unix_ns) == 12
    assert res.token_times_unix_ns == sorted(res.token_times_unix_ns)
    t = res.server_timings
    assert 0 < t["ttft_s"] <= t["e2e_s"] and t["queue_s"] <= t["ttft_s"] and t["tpot_s"] > 0


def test_final_message_carries_resolved_versions(served):
    _, client = served
    res = client.generate("abc", max_tokens=2)
    assert res.versions == {
        "name": "mock",
        "revision": "mock-rev-1",
        "tokenizer_hash": "bytes-v1",
        "chat_template_hash": "mock-chat-v1",
        "engine_version": "mock-engine-0.1",
        "speculative": "off",
    }


def test_non_streaming_is_one_message(served):
    _, client = served
    res = client.generate("xyz", max_tokens=5, stream=False)
    assert res.ok and res.num_messages == 1
    assert res.text == "{|}~ " and res.finish_reason == "length"


def test_chat_prompt_applies_template(served):
    _, client = served
    msgs = [{"role": "user", "content": "hi"}]
    templated = MockEngine().tokenizer.apply_chat_template(msgs)  # ends "<assistant>"
    res = client.generate(messages=msgs, max_tokens=3)
    assert res.prompt_tokens == len(templated.encode()) and res.text == "?@A"  # after ">"


def test_token_id_prompt_stop_string_and_prefix_cache(served):
    _, client = served
    res = client.generate(token_ids=list(b"qa"), max_tokens=20, stop=["efg"])
    assert (res.text, res.finish_reason) == ("bcd", "stop")
    res = client.generate("a", max_tokens=20, stop_token_ids=[ord("d")])
    assert (res.token_ids, res.text, res.finish_reason) == ([98, 99, 100], "bc", "stop")
    first = client.generate("0123456789", max_tokens=1)
    second = client.generate("0123456789", max_tokens=1)
    assert (first.cached_tokens, second.cached_tokens) == (0, 8)  # page_size 4


@pytest.mark.parametrize(
    "fields,field",
    [
        (dict(prompt="abc", temperature=-1.0), "temperature"),
        (dict(prompt="abc", top_p=0.0), "top_p"),
        (dict(prompt="abc", top_k=-2), "top_k"),
        (dict(prompt="abc", logprobs=99), "logprobs"),
        (dict(prompt="abc", max_tokens=65), "max_tokens"),  # above the limit 64
        (dict(prompt="a" * 100, max_tokens=29), "max_tokens"),  # 100 + 29 > 128
        (dict(prompt="a" * 101, max_tokens=1), "prompt"),
        (dict(prompt="", max_tokens=1), "prompt"),
        (dict(max_tokens=1), "prompt"),  # no prompt at all
        (dict(token_ids=[97, 300], max_tokens=1), "token_ids"),
        (dict(prompt="abc", max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(prompt="abc", stop=["x", "y", "z"]), "stop"),
        (dict(messages=[{"role": "robot", "content": "x"}]), "role"),
        (dict(prompt="abc", request_id="x" * 257), "request_id"),
        (dict(prompt="abc", structured={"regex": "a("}), "structured.regex"),
        (dict(prompt="abc", structured={"json_schema": {"type": "objekt"}}), "Invalid type"),
        (dict(prompt="abc", structured={"json_schema": "{bad"}), "structured.json_schema"),
        (dict(prompt="abc", structured={"choice": []}), "structured.choice"),
        (dict(prompt="abc", structured={"grammar": "start: nope"}), "structured.grammar"),
    ],
)
def test_bad_input_is_invalid_argument_naming_field(served, fields, field):
    _, client = served
    res = client.generate(**fields)
    assert res.code == "INVALID_ARGUMENT", (res.code, res.details)
    assert field in res.details


def test_revision_pin(served):
    _, client = served
    assert client.generate("a", max_tokens=1, revision="mock-rev-1").ok
    res = client.generate("a", max_tokens=1, revision="mock-rev-0")
    assert res.code == "FAILED_PRECONDITION" and "mock-rev-0" in res.details
    assert client.generate("a", max_tokens=1, model="llama").code == "FAILED_PRECONDITION"


def test_expired_deadline_is_deadline_exceeded(served):
    server, client = served
    before = outcome_counts(server).get(("timed_out", "deadline"), 0)
    # 60 steps of >= 1 ms cannot fit 20 ms: the capacity model sheds it at once
    res = client.generate("abc", max_tokens=60, timeout_s=0.02)
    assert res.code == "RESOURCE_EXHAUSTED" and "exceeds the deadline" in res.details
    # without the model (as before it is seeded) the deadline passes during generation
    engine = MockEngine(step_time_s=0.002)
    with running_server(engine, capacity_probe=False) as (unmodelled, c):
        assert c.generate("abc", max_tokens=60, timeout_s=0.02).code == "DEADLINE_EXCEEDED"
        wait_for(
            lambda: outcome_counts(unmodelled).get(("timed_out", "deadline"), 0) == 1,
            what="timed_out outcome",
        )
    assert outcome_counts(server).get(("timed_out", "deadline"), 0) == before


def test_tokenize_list_models_server_info(served):
    _, client = served
    assert client.tokenize("héllo") == list("héllo".encode())
    models = client.list_models().models
    assert [m.versions.name for m in models] == ["mock"] and models[0].max_model_len == 128
    info = client.server_info()
    assert info.kv_capacity_tokens == (64 - 1) * 4  # page 0 is the reserved null page
    assert (info.limits.max_tokens, info.limits.max_model_len) == (64, 128)
    assert info.circuit_breaker == "closed" and "kv_usage" in info.stats


def test_health_and_reflection(served):
    _, client = served
    health = health_pb2_grpc.HealthStub(client.channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    assert (
        health.Check(health_pb2.HealthCheckRequest(service="pagedjax.v1.PagedJax")).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    refl = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    reqs = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="pagedjax.v1.PagedJax"),
    ]
    responses = list(refl.ServerReflectionInfo(iter(reqs)))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"pagedjax.v1.PagedJax", "grpc.health.v1.Health"} <= names
    assert responses[1].file_descriptor_response.file_descriptor_proto


def test_metrics_endpoint_scrapes(served):
    server, client = served
    assert client.generate("abc", max_tokens=3).ok
    wait_for(lambda: server.metrics.kv_pages_free._value.get() > 0, what="stats published")
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    for name in (
        "pagedjax_time_to_first_token_seconds_bucket",
        "pagedjax_inter_token_latency_seconds_bucket",
        "pagedjax_e2e_request_latency_seconds_count",
        "pagedjax_queue_time_seconds_sum",
        "pagedjax_kv_pages_free",
        "pagedjax_kv_usage_ratio",
        "pagedjax_num_requests_running",
        "pagedjax_generation_tokens_total",
        "pagedjax_prefix_cache_queries_tokens_total",
    ):
        assert name in body, name
    assert (
        'pagedjax_request_outcomes_total{model="mock",outcome="success",reason=""'
        ',revision="mock-rev-1"}' in body
    )


def test_tenants_from_api_key_and_token_budget(tmp_path):
    cfg = {"tenants": [{"name": "acme", "api_keys": ["k-acme"], "tokens_per_minute": 100}]}
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(cfg))
    with running_server(tenants=TenantRegistry.from_file(str(path)), api_key="k-acme") as (
        server,
        client,
    ):
        target = f"127.0.0.1:{server.port}"
        with GenerateClient(target, api_key="wrong") as bad:
            assert bad.generate("abc", max_tokens=2).code == "UNAUTHENTICATED"
        with GenerateClient(target) as anonymous:
            assert anonymous.generate("abc", max_tokens=2).code == "UNAUTHENTICATED"
        # each call reserves 3 + 40 = 43 of 100 tokens and uses all of it (no refund)
        assert client.generate("abc", max_tokens=40).ok
        assert client.generate("abc", max_tokens=40).ok
        res = client.generate("abc", max_tokens=40)
        assert res.code == "RESOURCE_EXHAUSTED" and "acme" in res.details
        # about 14 tokens left, 29 short at 100/60 tokens per s: about 17 s
        assert 15_000 <= res.retry_after_ms <= 18_000
        counts = outcome_counts(server)
        assert counts[("rejected", "unauthenticated")] == 2
        assert counts[("rejected", "tenant_tokens")] == 1 and counts[("success", "")] == 2


def test_tenant_concurrency_limit():
    registry = TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "solo", "api_keys": ["k-solo"], "max_concurrency": 1},
                {"name": "other", "api_keys": ["k-other"]},
            ]
        }
    )
    with running_server(tenants=registry, api_key="k-solo") as (server, client):
        call = client.stream(build_request("abc", max_tokens=300))
        next(call)
        res = client.generate("abc", max_tokens=2)
        assert res.code == "RESOURCE_EXHAUSTED" and res.retry_after_ms > 0
        with GenerateClient(f"127.0.0.1:{server.port}", api_key="k-other") as other:
            assert other.generate("abc", max_tokens=2).ok  # limits are per tenant
        call.cancel()
        wait_for(lambda: server.limiter.active("solo") == 0, what="slot released")
        assert client.generate("abc", max_tokens=2).ok
        counts = outcome_counts(server)
        assert counts[("rejected", "tenant_concurrency")] == 1


def test_build_request_fields():
    req = build_request(
        "hi", max_tokens=3, temperature=0.0, seed=7, priority="high", stop=["x"], stream=False
    )
    assert req.WhichOneof("prompt") == "text" and req.max_tokens == 3
    assert req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")
    assert req.priority == pb.PRIORITY_HIGH and list(req.stop) == ["x"]
    assert not build_request("hi").HasField("max_tokens")


def test_identity_is_configurable():
    engine = MockEngine(identity=MockIdentity(revision="r2"))
    with running_server(engine) as (_, client):
        assert client.generate("a", max_tokens=1, revision="r2").versions["revision"] == "r2"


@pytest.mark.subprocess
def test_client_cli_prints_tokens_and_summary(served):
    server, _ = served
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.client",
            f"--target=127.0.0.1:{server.port}",
            "--prompt=abc",
            "--raw",
            "--max_tokens=5",
            "--stream",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith("defgh\n")
    assert "[length] prompt=3 cached=0 completion=5" in out and "mock@mock-rev-1" in out


def test_delta_message_merges_outputs_with_logprobs():
    from engine.api_types import RequestOutput, TokenLogprob
    from serving.grpc_api import convert

    outs = [
        RequestOutput(
            "r", [5], "a", [1.0], logprobs=[TokenLogprob(5, -0.5, [(5, -0.5), (6, -1.5)])]
        ),
        RequestOutput("r", [7, 8], "bc", [2.0, 2.5], logprobs=None),
    ]
    msg = convert.delta_message("r", outs)
    assert list(msg.token_ids) == [5, 7, 8] and msg.text == "abc"
    assert len(msg.token_times_unix_ns) == 3
    assert msg.token_times_unix_ns[2] - msg.token_times_unix_ns[0] == 1_500_000_000
    assert msg.logprobs[0].token_id == 5 and msg.logprobs[0].logprob == -0.5
    assert [(t.token_id, t.logprob) for t in msg.logprobs[0].top] == [(5, -0.5), (6, -1.5)]
