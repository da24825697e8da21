"""The OpenAI-compatible HTTP API end to end, driven by the official `openai` SDK (a client
nobody here wrote) and raw httpx, against a real server (MockEngine) on localhost."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from serving.client import build_request
from serving.engine_host.mock_engine import MockEngine, expected_continuation
from serving.frontend.admission import AdmissionConfig
from serving.frontend.tenants import TenantPolicy, TenantRegistry
from serving.testing import calls_seen, outcome_counts, running_server, wait_for

ADMISSION = AdmissionConfig(
    max_prompt_tokens=100, max_tokens=64, max_model_len=128, max_stop_strings=2
)
CHAT = [{"role": "user", "content": "hi"}]
CHAT_PROMPT = "<user>hi\n<assistant>"  # the mock's template; the mock continues after ">"


def _sdk(server, key="unused", cls=openai.OpenAI):
    return cls(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=key, max_retries=0)


def _url(server, path):
    return f"http://127.0.0.1:{server.http_port}{path}"


@pytest.fixture(scope="module")
def served():
    engine = MockEngine(page_size=4, num_pages=64, step_time_s=0.001)
    with running_server(engine, admission=ADMISSION, http_port=0) as (server, client):
        yield server, client, _sdk(server)


# ---- generation ------------------------------------------------------------------------------
def test_completion_equals_mock_output_with_usage_and_identity(served):
    server, _, sdk = served
    raw = sdk.completions.with_raw_response.create(model="mock", prompt="abc", max_tokens=12)
    r = raw.parse()
    assert r.choices[0].text == "defghijklmno" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 12, 15)
    assert r.model == "mock" and r.object == "text_completion"
    assert r.system_fingerprint == (
        "pagedjax-mock-engine-0.1;rev=mock-rev-1;tok=bytes-v1;tpl=mock-chat-v1"
    )
    assert raw.headers["x-pagedjax-revision"] == "mock-rev-1"
    assert raw.headers["x-pagedjax-tokenizer-hash"] == "bytes-v1"
    assert raw.headers["x-pagedjax-chat-template-hash"] == "mock-chat-v1"
    assert r.pagedjax["versions"]["revision"] == "mock-rev-1"
    timings = r.pagedjax["timings"][0]
    assert 0 < timings["ttft_s"] <= timings["e2e_s"]


def test_chat_streamed_text_equals_non_streamed_and_carries_usage_and_versions(served):
    _, _, sdk = served
    full = sdk.chat.completions.create(model="mock", messages=CHAT, max_tokens=9)
    assert full.choices[0].message.content == "?@ABCDEFG"  # after ">" of the template
    assert full.usage.prompt_tokens == len(CHAT_PROMPT) and full.usage.completion_tokens == 9
    chunks = list(
        sdk.chat.completions.create(
            model="mock",
            messages=CHAT,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 9
    assert last.usage.prompt_tokens == len(CHAT_PROMPT)
    assert last.pagedjax["versions"]["revision"] == "mock-rev-1"
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.system_fingerprint for c in chunks} == {full.system_fingerprint}


def test_streamed_completion_without_usage_ends_with_versions(served):
    _, _, sdk = served
    chunks = list(sdk.completions.create(model="mock", prompt="xyz", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "{|}~ "
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].pagedjax["versions"]["name"] == "mock"


def test_async_client_chat_and_completions(served):
    server, _, _ = served

    async def main():
        sdk = _sdk(server, cls=openai.AsyncOpenAI)
        full = await sdk.completions.create(model="mock", prompt="abc", max_tokens=4)
        stream = await sdk.chat.completions.create(
            model="mock", messages=CHAT, max_tokens=4, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        both = await asyncio.gather(
            *(sdk.completions.create(model="mock", prompt=p, max_tokens=3) for p in ("a", "b"))
        )
        await sdk.close()
        return full.choices[0].text, text, [r.choices[0].text for r in both]

    assert asyncio.run(main()) == ("defg", "?@AB", ["bcd", "cde"])


def test_n_choices_are_engine_requests_sharing_the_prefix_cache(served):
    server, _, sdk = served
    engine = server.engine
    prompt = "0123456789ab"  # 12 tokens: 8 cacheable (pages of 4, at most len - 1)
    sdk.completions.create(model="mock", prompt=prompt, max_tokens=1)  # computes its pages
    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    r = sdk.completions.create(model="mock", prompt=prompt, max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == ["cde", "cde"]
    assert r.usage.prompt_tokens == 12 and r.usage.completion_tokens == 6  # prompt once
    # Each choice is its own engine request and hits the cached prompt pages. (Pages enter
    # the cache once computed: two choices admitted in one step would each compute them.)
    assert engine.stats()["prefix_cache_hit_tokens"] - hits_before == 2 * 8


def test_list_of_prompts_and_token_id_prompts(served):
    _, _, sdk = served
    r = sdk.completions.create(model="mock", prompt=["a", "b"], max_tokens=2, n=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, "bc"), (1, "bc"), (2, "cd"), (3, "cd")]
    assert r.usage.prompt_tokens == 2
    r = sdk.completions.create(model="mock", prompt=[113, 97], max_tokens=20, stop=["efg"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("bcd", "stop")
    r = sdk.completions.create(model="mock", prompt=[[97], [98]], max_tokens=1)
    assert [c.text for c in r.choices] == ["b", "c"]


def test_stop_strings_and_vllm_extras(served):
    _, _, sdk = served
    r = sdk.completions.create(model="mock", prompt="a", max_tokens=20, stop="efg")
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("bcd", "stop")
    r = sdk.completions.create(
        model="mock",
        prompt="a",
        max_tokens=20,
        extra_body={"stop_token_ids": [ord("d")], "top_k": -1, "min_p": 0.0, "priority": -1},
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("bc", "stop")
    r = sdk.completions.create(
        model="mock",
        prompt="a",
        max_tokens=6,
        extra_body={"stop_token_ids": [ord("c")], "min_tokens": 4, "ignore_eos": True},
    )
    # "c" is banned before min_tokens (as on the device), so "b" is followed by "d".
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("bdefgh", "length")
    chunks = list(
        sdk.completions.create(model="mock", prompt="a", max_tokens=20, stop=["efg"], stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == "bcd"


# ---- errors ----------------------------------------------------------------------------------
def test_unsupported_fields_are_refused_by_name(served):
    _, _, sdk = served
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="mock", prompt="a", max_tokens=2, logit_bias={"1": 2})
    assert e.value.body["param"] == "logit_bias" and "unsupported field" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(
            model="mock", messages=[{"role": "user", "content": "x", "name": "bob"}]
        )
    assert e.value.body["param"] == "messages.0.name"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(
            model="mock",
            messages=CHAT,
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    assert e.value.body["param"] == "tools"


def test_invalid_values_name_field_value_and_limit(served):
    _, _, sdk = served
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="mock", prompt="a", max_tokens=2, temperature=500)
    assert e.value.body["param"] == "temperature"
    assert "temperature=500" in e.value.message and "0 <= x <= 100" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="mock", prompt="a", max_tokens=65)
    assert e.value.body["param"] == "max_tokens" and "at most 64" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="mock", prompt="a", max_tokens=2, n=17)
    assert e.value.body["param"] == "n" and "n <= 16" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="mock", prompt=[300], max_tokens=2)
    assert "prompt=300" in e.value.message and "256" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="mock", prompt="a", max_tokens="5")  # strict JSON types
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="mock", messages=CHAT, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_structured_output_fields_are_validated_and_named(served):
    _, _, sdk = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    for extra in (
        {"response_format": fmt},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "text"}},
        {"guided_json": schema},
        {"guided_json": json.dumps(schema)},
        {"guided_regex": "[a-z]+"},
        {"guided_choice": ["yes", "no"]},
        {"guided_grammar": 'start: "a"+'},
    ):  # accepted (the mock engine does not apply constraints; tests/test_structured.py does)
        sdk.chat.completions.create(model="mock", messages=CHAT, max_tokens=2, extra_body=extra)
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    for extra, param, message in (
        ({"guided_regex": "a("}, "guided_regex", "unclosed group"),
        ({"guided_json": {"$ref": "#/nope"}}, "guided_json", "does not exist"),
        ({"guided_choice": []}, "guided_choice", "1 to"),
        ({"guided_grammar": "start: x"}, "guided_grammar", "unknown name"),
        ({"response_format": bad_schema}, "response_format.json_schema.schema", "objekt"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "response_format", "at most one"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model="mock", messages=CHAT, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param and message in e.value.message, e.value.message


def test_unknown_model_is_404_and_revision_pin_is_409(served):
    server, _, sdk = served
    with pytest.raises(openai.NotFoundError) as e:
        sdk.completions.create(model="gpt-4", prompt="a", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.message
    with pytest.raises(openai.ConflictError) as e:
        sdk.completions.create(
            model="mock", prompt="a", max_tokens=2, extra_body={"revision": "rev-0"}
        )
    assert "rev-0" in e.value.message and e.value.body["param"] == "revision"
    with pytest.raises(openai.ConflictError):
        sdk.completions.create(
            model="mock", prompt="a", max_tokens=2, extra_headers={"x-pagedjax-revision": "old"}
        )
    r = sdk.completions.create(
        model="mock", prompt="a", max_tokens=2, extra_body={"revision": "mock-rev-1"}
    )
    assert r.choices[0].text == "bc"


def test_queue_full_is_rate_limit_error_with_retry_after_headers():
    admission = AdmissionConfig(max_queue_requests=0, default_retry_after_ms=1500)
    with running_server(MockEngine(), admission=admission, http_port=0) as (server, _):
        with pytest.raises(openai.RateLimitError) as e:
            _sdk(server).completions.create(model="mock", prompt="a", max_tokens=2)
        headers = e.value.response.headers
        assert (headers["retry-after"], headers["retry-after-ms"]) == ("2", "1500")
        assert e.value.body["code"] == "queue_full"
        assert outcome_counts(server) == {("rejected", "queue_full"): 1}


def test_api_keys_map_to_the_same_tenants_and_budgets_as_grpc():
    tenants = TenantRegistry(
        {"acme": TenantPolicy("acme", max_concurrency=1)},
        {"k-acme": "acme"},
        allow_anonymous=False,
    )
    engine = MockEngine(step_time_s=0.002)
    with running_server(engine, tenants=tenants, http_port=0, api_key="k-acme") as (server, grpc):
        with pytest.raises(openai.AuthenticationError) as e:
            _sdk(server, key="k-wrong").completions.create(model="mock", prompt="a", max_tokens=1)
        assert e.value.body["code"] == "unauthenticated"
        r = httpx.post(
            _url(server, "/v1/completions"),
            json={"prompt": "a", "max_tokens": 1},
            headers={"x-api-key": "k-acme"},
        )
        assert r.json()["choices"][0]["text"] == "b"  # gRPC's header works too
        assert httpx.get(_url(server, "/v1/models")).status_code == 401  # no key, no anonymous
        sdk = _sdk(server, key="k-acme")
        r = sdk.completions.create(model="mock", prompt="a", max_tokens=2)
        assert r.choices[0].text == "bc"
        call = grpc.stream(build_request("abc", max_tokens=60, request_id="held"))  # acme's one
        next(iter(call))
        with pytest.raises(openai.RateLimitError) as e:
            sdk.completions.create(model="mock", prompt="a", max_tokens=1)
        assert e.value.body["code"] == "tenant_concurrency"
        assert e.value.response.headers["retry-after-ms"] == "1000"
        call.cancel()
        wait_for(lambda: server.limiter.active("acme") == 0, what="tenant slot released")
        assert sdk.completions.create(model="mock", prompt="a", max_tokens=1).choices[0].text == "b"


def test_breaker_open_is_503_and_failed_stream_raises_api_error():
    engine = MockEngine(step_time_s=0.001)
    with running_server(
        engine, http_port=0, breaker_failure_threshold=1, breaker_cooldown_s=30
    ) as (server, _):
        sdk = _sdk(server)
        engine.fail_next_steps(1)
        with pytest.raises(openai.APIError) as e:
            list(sdk.completions.create(model="mock", prompt="a", max_tokens=5, stream=True))
        assert "engine step failed" in str(e.value)
        with pytest.raises(openai.InternalServerError) as e:
            sdk.completions.create(model="mock", prompt="a", max_tokens=5)
        assert e.value.status_code == 503 and e.value.body["code"] == "circuit_open"
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert httpx.get(_url(server, "/health")).status_code == 503
        ready = httpx.get(_url(server, "/ready"))
        assert ready.status_code == 503 and ready.json()["reason"] == "circuit_open"


# ---- disconnects, slow readers, outcomes ------------------------------------------------------
def test_sse_disconnect_cancels_and_frees_pages_within_a_step(served):
    server, _, _ = served
    engine = server.engine
    body = {"model": "mock", "prompt": "abc", "max_tokens": 60, "stream": True}
    before = outcome_counts(server).get(("cancelled", "client"), 0)
    with httpx.stream("POST", _url(server, "/v1/completions"), json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    wait_for(lambda: outcome_counts(server).get(("cancelled", "client"), 0) == before + 1)
    wait_for(lambda: any(e[0].startswith("cmpl-") for e in engine.abort_log), what="abort")
    (_, abort_step, freed_step) = next(e for e in engine.abort_log if e[0].startswith("cmpl-"))
    assert freed_step - abort_step <= 1
    wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")


def test_non_streamed_disconnect_cancels_the_request():
    engine = MockEngine(step_time_s=0.01)
    with running_server(engine, http_port=0) as (server, _):
        body = {"model": "mock", "prompt": "abc", "max_tokens": 400}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(_url(server, "/v1/completions"), json=body, timeout=0.3)
        wait_for(lambda: outcome_counts(server) == {("cancelled", "client"): 1})
        wait_for(lambda: len(engine.abort_log) == 1, what="abort")
        assert engine.abort_log[0][2] - engine.abort_log[0][1] <= 1
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")


def test_slow_sse_reader_is_cancelled_by_the_same_bounded_buffer():
    """A reader whose transport never drains (send blocks) stops the relay, the engine fills
    the stream buffer, and the request ends cancelled{slow_consumer}, as on gRPC."""
    engine = MockEngine(step_time_s=0.001)
    with running_server(engine, http_port=0, stream_buffer_messages=4) as (server, _):
        app = server.http_api.app
        body = b'{"model": "mock", "prompt": "abc", "max_tokens": 200, "stream": true}'
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }

        async def drive():
            sent, stuck = [], asyncio.Event()
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                if messages:
                    return messages.pop()
                await asyncio.Event().wait()  # the client never leaves

            async def send(message):
                sent.append(message)
                if message["type"] == "http.response.body" and message.get("body"):
                    stuck.set()
                    await asyncio.Event().wait()  # the reader never drains its socket

            task = asyncio.ensure_future(app(scope, receive, send))
            await stuck.wait()
            await asyncio.to_thread(
                wait_for,
                lambda: ("cancelled", "slow_consumer") in outcome_counts(server),
                10.0,
                "slow consumer cancelled",
            )
            task.cancel()
            return sent

        sent = asyncio.run(drive())
        assert sent[0]["status"] == 200
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
        assert outcome_counts(server) == {("cancelled", "slow_consumer"): 1}


def test_one_outcome_per_request_counted_once_across_both_transports():
    engine = MockEngine(step_time_s=0.002)
    admission = AdmissionConfig(max_tokens=32)
    with running_server(engine, admission=admission, http_port=0) as (server, grpc):
        sdk = _sdk(server)
        assert grpc.generate("abc", max_tokens=4).ok
        assert not grpc.generate("abc", max_tokens=33).ok
        sdk.completions.create(model="mock", prompt="abc", max_tokens=4, n=2)
        sdk.chat.completions.create(model="mock", messages=CHAT, max_tokens=3)
        with pytest.raises(openai.BadRequestError):
            sdk.completions.create(model="mock", prompt="a", max_tokens=33)
        with pytest.raises(openai.BadRequestError):
            sdk.completions.create(model="mock", prompt="a", extra_body={"bogus": 1})
        with httpx.stream(
            "POST",
            _url(server, "/v1/completions"),
            json={"model": "mock", "prompt": "a", "max_tokens": 30, "stream": True},
        ) as r:
            next(r.iter_lines())
        wait_for(lambda: sum(outcome_counts(server).values()) == 8, what="8 outcomes")
        assert outcome_counts(server) == {
            ("success", ""): 4,  # gRPC 1, HTTP n=2 (two engine requests), chat 1
            ("rejected", "invalid_argument"): 3,
            ("cancelled", "client"): 1,
        }
        assert calls_seen(server) == 8
        metrics = httpx.get(_url(server, "/metrics")).text
        assert 'pagedjax_request_outcomes_total{model="mock",outcome="success"' in metrics
        assert "pagedjax_generate_calls_total" in metrics


def test_refused_sibling_choice_cancels_the_admitted_ones():
    engine = MockEngine(step_time_s=0.002)
    admission = AdmissionConfig(max_queue_requests=1)
    with running_server(engine, admission=admission, http_port=0, max_inflight=1) as (server, _):
        with pytest.raises(openai.RateLimitError):
            _sdk(server).completions.create(model="mock", prompt="abc", max_tokens=50, n=3)
        wait_for(lambda: sum(outcome_counts(server).values()) == calls_seen(server))
        # Choice 0 may already be in the engine when choice 1 arrives, so 1 or 2 get in.
        admitted = calls_seen(server) - 1
        assert admitted in (1, 2)
        assert outcome_counts(server) == {
            ("rejected", "queue_full"): 1,
            ("cancelled", "sibling_refused"): admitted,
        }
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")


# ---- the other endpoints, raw HTTP ------------------------------------------------------------
def test_health_ready_models_and_metrics(served):
    server, _, sdk = served
    assert httpx.get(_url(server, "/health")).json() == {"status": "closed"}
    assert httpx.get(_url(server, "/ready")).json() == {"ready": True, "reason": None}
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["mock"]
    assert models.data[0].max_model_len == 128
    metrics = httpx.get(_url(server, "/metrics"))
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "pagedjax_time_to_first_token_seconds_bucket" in metrics.text


def test_tokenize_and_detokenize(served):
    server, _, _ = served
    r = httpx.post(_url(server, "/tokenize"), json={"model": "mock", "prompt": "hi!"})
    assert r.json() == {"count": 3, "max_model_len": 128, "tokens": [104, 105, 33]}
    r = httpx.post(_url(server, "/tokenize"), json={"messages": CHAT})
    assert r.json()["tokens"] == list(CHAT_PROMPT.encode())
    r = httpx.post(_url(server, "/detokenize"), json={"tokens": [104, 105, 33]})
    assert r.json() == {"prompt": "hi!"}
    r = httpx.post(_url(server, "/detokenize"), json={"tokens": [104, 999]})
    assert r.status_code == 400 and "tokens=999" in r.json()["error"]["message"]
    r = httpx.post(_url(server, "/tokenize"), json={"prompt": "a", "messages": CHAT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(_url(server, "/tokenize"), content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_not_ready_until_warm_up_ends():
    release = threading.Event()
    engine = MockEngine(step_time_s=0.001)
    warmup = lambda stop: release.wait(30)  # noqa: E731
    with running_server(engine, http_port=0, warmup=warmup) as (server, grpc):
        ready = httpx.get(_url(server, "/ready"))
        assert ready.status_code == 503 and ready.json()["reason"] == "warming_up"
        with pytest.raises(openai.InternalServerError) as e:
            _sdk(server).completions.create(model="mock", prompt="a", max_tokens=1)
        assert e.value.status_code == 503 and e.value.body["code"] == "warming_up"
        res = grpc.generate("a", max_tokens=1)
        assert res.code == "UNAVAILABLE" and "warming up" in res.details
        release.set()
        wait_for(lambda: httpx.get(_url(server, "/ready")).status_code == 200, what="ready")
        assert grpc.generate("a", max_tokens=1).text == "b"
        assert outcome_counts(server)[("rejected", "warming_up")] == 2


def test_expected_continuation_reference_still_holds(served):
    """Token ids cross HTTP only as text; the mock's reference gives the same text."""
    _, _, sdk = served
    r = sdk.completions.create(model="mock", prompt="~", max_tokens=3)
    assert r.choices[0].text == bytes(expected_continuation(ord("~"), 3)).decode()


def test_draining_server_refuses_new_requests_with_503(served):
    server, _, sdk = served
    server.generator.draining = True
    try:
        with pytest.raises(openai.InternalServerError) as e:
            sdk.completions.create(model="mock", prompt="a", max_tokens=1)
        assert e.value.status_code == 503 and e.value.body["code"] == "draining"
        assert httpx.get(_url(server, "/ready")).json() == {"ready": False, "reason": "draining"}
    finally:
        server.generator.draining = False


def test_stream_options_without_stream_is_refused(served):
    _, _, sdk = served
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(
            model="mock", prompt="a", max_tokens=1, stream_options={"include_usage": True}
        )
    assert e.value.body["param"] == "stream_options"


@pytest.mark.subprocess
def test_server_program_serves_http_on_the_flag_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving.server",
            "--model=mock",
            "--host=127.0.0.1",
            "--port=0",
            "--metrics_port=-1",
            f"--http_port={port}",
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines[0].startswith("serving on ") and lines[1] == f"http on {port}\n"
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "mock", "prompt": "abc", "max_tokens": 3},
        )
        assert r.json()["choices"][0]["text"] == "def"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_empty_messages_are_refused_naming_messages(served):
    _, _, sdk = served
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model="mock", messages=[], max_tokens=1)
    assert e.value.body["param"] == "messages" and "at least one message" in e.value.message


def test_continuous_usage_stats_count_tokens_so_far(served):
    _, _, sdk = served
    chunks = list(
        sdk.completions.create(
            model="mock",
            prompt="abc",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    so_far = [c.usage.completion_tokens for c in chunks]
    assert so_far == sorted(so_far) and so_far[-1] == 6
    text = ""
    for c in chunks[:-1]:
        text += c.choices[0].text
        assert c.usage.completion_tokens == len(text)  # the mock: one byte per token
        assert c.usage.prompt_tokens == 3


def test_streamed_n_choices_interleave_and_match_the_non_streamed(served):
    _, _, sdk = served
    full = sdk.chat.completions.create(model="mock", messages=CHAT, max_tokens=7, n=2)
    chunks = list(
        sdk.chat.completions.create(
            model="mock",
            messages=CHAT,
            max_tokens=7,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finish = {0: "", 1: ""}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 14 == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens == len(CHAT_PROMPT)
    assert [t["e2e_s"] > 0 for t in chunks[-1].pagedjax["timings"]] == [True, True]


def test_failed_warm_up_leaves_the_server_not_ready(caplog):
    def broken(stop):
        raise RuntimeError("compile failed")

    with running_server(MockEngine(), http_port=0, warmup=broken) as (server, _):
        wait_for(lambda: "warm-up failed" in caplog.text, what="warm-up failure logged")
        ready = httpx.get(_url(server, "/ready"))
        assert ready.status_code == 503 and ready.json()["reason"] == "warming_up"
        assert server.loop.thread.is_alive()
