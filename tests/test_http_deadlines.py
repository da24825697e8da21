"""HTTP requests carry their deadline (serving/frontend/deadlines.py, issue 37): the official
`openai` SDK's `timeout=` (its x-stainless-read-timeout header), our x-request-timeout-ms header, a
tenant's or the server's default. Against a MockEngine with a known step time: a call whose
deadline cannot be met is refused with 429 + Retry-After before the engine sees it; one that
can is served; one that runs past it ends timed_out{deadline} with its pages freed; a client
that leaves cancels its request within a step."""

import asyncio
import json
import logging
import threading

import httpx
import openai
import pytest

from serving.engine_host.mock_engine import MockEngine, expected_continuation
from serving.frontend.admission import AdmissionConfig, QueuedRequest, Rejected, WaitingQueue
from serving.frontend.capacity_model import CapacityModel
from serving.frontend.deadlines import REQUEST_TIMEOUT_HEADER, SDK_TIMEOUT_HEADER
from serving.frontend.tenants import TenantPolicy, TenantRegistry
from serving.testing import outcome_counts, running_server, wait_for

STEP_S = 0.02  # the mock's step time: 400 tokens take >= 8 s, 5 tokens ~0.1 s


def _sdk(server, timeout: float, key="unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1",
        api_key=key,
        timeout=timeout,
        max_retries=0,
    )


def _url(server, path="/v1/completions"):
    return f"http://127.0.0.1:{server.http_port}{path}"


def _engine_sees(engine) -> list[str]:
    """Request ids the engine is handed from now on."""
    seen, add = [], engine.add_request

    def add_request(request, *args, **kwargs):
        seen.append(request.request_id)
        return add(request, *args, **kwargs)

    engine.add_request = add_request
    return seen


def _log_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "pagedjax.requests"]


@pytest.fixture(scope="module")
def probed():
    """A server whose admission knows the step time (capacity probe at start-up)."""
    engine = MockEngine(step_time_s=STEP_S)
    with running_server(engine, http_port=0, max_inflight=4) as (server, _):
        yield server


@pytest.fixture
def requests_log(caplog):
    caplog.set_level(logging.INFO, logger="pagedjax.requests")
    return caplog


# ---- admission ---------------------------------------------------------------------------------
def test_sdk_timeout_that_cannot_be_met_is_refused_with_429_before_any_work(probed, requests_log):
    server = probed
    seen = _engine_sees(server.engine)
    before = outcome_counts(server).get(("rejected", "deadline"), 0)
    with pytest.raises(openai.RateLimitError) as e:
        _sdk(server, timeout=1.0).completions.create(model="mock", prompt="abc", max_tokens=400)
    assert e.value.status_code == 429 and e.value.code == "deadline"
    assert int(e.value.response.headers["Retry-After"]) >= 1
    assert int(e.value.response.headers["retry-after-ms"]) > 0
    assert "exceeds the deadline" in e.value.message
    assert seen == []  # refused before the engine got it
    assert outcome_counts(server)[("rejected", "deadline")] == before + 1
    line = _log_lines(requests_log)[-1]
    assert (line["reason"], line["timeout_s"], line["timeout_source"]) == (
        "deadline",
        0.9,  # 1 s less the lead that lets a 504 reach the client before its own timeout
        SDK_TIMEOUT_HEADER,
    )


def test_sdk_timeout_that_can_be_met_is_served(probed, requests_log):
    server = probed
    sdk = _sdk(server, timeout=30.0)
    r = sdk.completions.create(model="mock", prompt="abc", max_tokens=5)
    assert r.choices[0].text == "defgh"
    chunks = sdk.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == bytes(expected_continuation(ord(">"), 5)).decode()
    # the stream's success is recorded once [DONE] was handed over, maybe after it was read
    wait_for(lambda: len(_log_lines(requests_log)) == 2, what="two request log lines")
    lines = _log_lines(requests_log)
    assert [(x["outcome"], x["timeout_s"], x["timeout_source"]) for x in lines] == [
        ("success", 29.5, SDK_TIMEOUT_HEADER)
    ] * 2


def test_own_header_comes_before_the_sdk_timeout(probed, requests_log):
    server = probed
    with pytest.raises(openai.RateLimitError) as e:
        _sdk(server, timeout=60.0).completions.create(
            model="mock",
            prompt="abc",
            max_tokens=400,
            extra_headers={REQUEST_TIMEOUT_HEADER: "1500"},
        )
    assert e.value.code == "deadline"
    line = _log_lines(requests_log)[-1]
    assert (line["timeout_s"], line["timeout_source"]) == (1.35, REQUEST_TIMEOUT_HEADER)


@pytest.mark.parametrize(
    "header, value",
    [
        (REQUEST_TIMEOUT_HEADER, "soon"),
        (REQUEST_TIMEOUT_HEADER, "0"),
        (REQUEST_TIMEOUT_HEADER, "-5"),
        (REQUEST_TIMEOUT_HEADER, "1e12"),
        (SDK_TIMEOUT_HEADER, "nan"),
        (SDK_TIMEOUT_HEADER, "inf"),
        (SDK_TIMEOUT_HEADER, ""),
    ],
)
def test_bad_timeout_header_is_400_naming_header_value_and_limit(probed, header, value):
    r = httpx.post(
        _url(probed),
        json={"model": "mock", "prompt": "abc", "max_tokens": 2},
        headers={header: value},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == header
    assert f"{header}={value!r}" in err["message"] and "> 0 and at most" in err["message"]


# ---- defaults: the tenant's, else the server's ---------------------------------------------------
def test_tenant_default_comes_before_the_server_default(requests_log):
    tenants = TenantRegistry(
        {"patient": TenantPolicy("patient", default_request_timeout_s=60.0)},
        {"k-patient": "patient"},
        allow_anonymous=True,
    )
    admission = AdmissionConfig(default_request_timeout_s=1.0)
    engine = MockEngine(step_time_s=STEP_S)
    config = dict(tenants=tenants, admission=admission, http_port=0, max_inflight=4)
    with running_server(engine, **config) as (server, _):
        body = {"model": "mock", "prompt": "abc", "max_tokens": 100}  # ~2 s of steps
        anonymous = httpx.post(_url(server), json=body, timeout=60)
        assert anonymous.status_code == 429 and anonymous.json()["error"]["code"] == "deadline"
        assert "Retry-After" in anonymous.headers
        auth = {"Authorization": "Bearer k-patient"}
        patient = httpx.post(_url(server), json=body, headers=auth, timeout=60)
        assert patient.status_code == 200
        wait_for(lambda: len(_log_lines(requests_log)) == 2, what="success recorded")
    lines = _log_lines(requests_log)
    assert [(x["timeout_s"], x["timeout_source"]) for x in lines] == [
        (1.0, "server"),
        (60.0, "tenant"),
    ]


def test_grpc_takes_the_same_defaults_and_logs_its_own_deadline(requests_log):
    admission = AdmissionConfig(default_request_timeout_s=1.0)
    engine = MockEngine(step_time_s=STEP_S)
    with running_server(engine, admission=admission, max_inflight=4) as (_, client):
        shed = client.generate("abc", max_tokens=100)  # no deadline: the server's 1 s
        assert (shed.code, shed.retry_after_ms is not None) == ("RESOURCE_EXHAUSTED", True)
        served = client.generate("abc", max_tokens=5, timeout_s=30)
        assert (served.code, served.text) == ("OK", "defgh")
        wait_for(lambda: len(_log_lines(requests_log)) == 2, what="success recorded")
    lines = _log_lines(requests_log)
    assert [(x["reason"], x["timeout_source"]) for x in lines] == [
        ("deadline", "server"),
        ("", "grpc-timeout"),
    ]
    assert lines[0]["timeout_s"] == 1.0 and 29 < lines[1]["timeout_s"] < 31  # gRPC rounds


def test_tenants_file_checks_the_default_timeout():
    with pytest.raises(ValueError, match="default_request_timeout_s=-1 must be"):
        TenantRegistry.from_dict({"tenants": [{"name": "a", "default_request_timeout_s": -1}]})
    registry = TenantRegistry.from_dict({"default": {"default_request_timeout_s": 2.5}})
    assert registry.default.default_request_timeout_s == 2.5


def test_a_long_deadline_does_not_lift_the_queue_timeout():
    """Every SDK call brings a deadline (600 s by default); a wait past the queue timeout is
    still refused at once, as the queue would drop the request at that timeout anyway."""
    model = CapacityModel({1: 1.0}, prefill_tokens_per_s=1e6, max_inflight=1)
    q = WaitingQueue(AdmissionConfig(queue_timeout_s=5.0), clock=lambda: 0.0, capacity=model)
    q.num_in_engine, q.engine_remaining_tokens = 1, [10]  # 10 s of steps ahead
    with pytest.raises(Rejected) as e:
        q.offer(QueuedRequest("r", 20, 1, 0.0, 600.0, prompt_tokens=10, max_tokens=10))
    assert e.value.reason == "queue_timeout"


# ---- expiry: the deadline bounds the whole response ---------------------------------------------
@pytest.fixture
def unprobed():
    """No capacity model: admission cannot predict, so the engine meets the deadline."""
    engine = MockEngine(page_size=4, num_pages=256, step_time_s=0.05)
    with running_server(engine, http_port=0, capacity_probe=False) as (server, _):
        yield server


def test_deadline_passing_while_running_is_504_timed_out_and_frees_pages(unprobed):
    server = unprobed
    body = {"model": "mock", "prompt": "abc", "max_tokens": 200}  # 10 s of steps
    r = httpx.post(_url(server), json=body, headers={REQUEST_TIMEOUT_HEADER: "500"}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert outcome_counts(server) == {("timed_out", "deadline"): 1}
    wait_for(lambda: server.engine.pool.num_used_pages == 0, what="pages freed")


def test_stream_keeps_the_deadline_for_the_whole_stream(unprobed):
    server = unprobed
    body = {"model": "mock", "prompt": "abc", "max_tokens": 200, "stream": True}
    events = []
    headers = {REQUEST_TIMEOUT_HEADER: "500"}
    with httpx.stream("POST", _url(server), json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200  # the stream started in time ...
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert 0 < len(text) < 200  # ... and was cut at the deadline, not at max_tokens
    assert json.loads(events[-1])["error"]["type"] == "timeout"
    assert outcome_counts(server) == {("timed_out", "deadline"): 1}
    wait_for(lambda: server.engine.pool.num_used_pages == 0, what="pages freed")


def test_deadline_ends_the_response_while_the_engine_is_stuck_in_a_step(unprobed):
    """As gRPC's runtime does: the response ends at the deadline even when the engine thread
    is inside a long step (e.g. compiling a new shape), and the request is timed out."""
    server, engine = unprobed, unprobed.engine
    finished_steps, step = [], engine.step

    def slow_step():
        out = step()
        finished_steps.append(engine.num_steps)
        return out

    engine.step, engine.step_time_s = slow_step, 3.0  # NOTE: 3 s >> the 0.5 s deadline
    body = {"model": "mock", "prompt": "abc", "max_tokens": 20}
    r = httpx.post(_url(server), json=body, headers={REQUEST_TIMEOUT_HEADER: "500"}, timeout=60)
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
    assert finished_steps == []  # answered while the first step still ran
    assert outcome_counts(server) == {("timed_out", "deadline"): 1}
    engine.step_time_s = 0.01
    wait_for(lambda: server.loop.num_active() == 0, what="request gone from the engine")
    wait_for(lambda: engine.pool.num_used_pages == 0, what="pages freed")


# ---- client disconnects -------------------------------------------------------------------------
def _abort_within_a_step(server, steps_at_disconnect: int) -> None:
    engine = server.engine
    wait_for(lambda: outcome_counts(server) == {("cancelled", "client"): 1}, what="cancelled")
    wait_for(lambda: len(engine.abort_log) == 1, what="abort")
    _, abort_step, freed_step = engine.abort_log[0]
    assert freed_step - abort_step <= 1  # the engine freed it at its next schedule()
    # NOTE: steps are 50 ms; the server learns of the disconnect in well under one
    assert abort_step - steps_at_disconnect <= 1
    wait_for(lambda: engine.pool.num_used_pages == 0, what="pages freed")


def test_streaming_client_that_leaves_frees_its_pages_within_a_step(unprobed):
    server, engine = unprobed, unprobed.engine
    no_deadline = {REQUEST_TIMEOUT_HEADER: "60000"}  # the disconnect, not a deadline, ends it
    stream = _sdk(server, timeout=60.0).completions.create(
        model="mock", prompt="abc", max_tokens=200, stream=True, extra_headers=no_deadline
    )
    assert next(iter(stream)).choices[0].text
    wait_for(lambda: engine.pool.num_used_pages > 0, what="pages in use")
    used = engine.pool.num_used_pages
    steps = engine.num_steps
    stream.close()
    _abort_within_a_step(server, steps)
    assert used >= 1 and engine.pool.num_used_pages == 0


def test_non_streaming_client_that_leaves_frees_its_pages_within_a_step(unprobed):
    server, engine = unprobed, unprobed.engine
    no_deadline = {REQUEST_TIMEOUT_HEADER: "60000"}
    left = {}

    def call():
        with pytest.raises(openai.APITimeoutError):
            _sdk(server, timeout=1.0).completions.create(
                model="mock", prompt="abc", max_tokens=200, extra_headers=no_deadline
            )
        left["steps"] = engine.num_steps

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: engine.pool.num_used_pages > 0, what="pages in use")
    caller.join(30)
    assert "steps" in left
    _abort_within_a_step(server, left["steps"])


def test_stream_disconnect_is_seen_under_asgi_spec_2_4(unprobed):
    """An ASGI 2.4 server tells Starlette nothing until a write fails; the relay still hears
    http.disconnect at once (http_delivery.DeliveryStreamingResponse), here from a client
    whose transport accepts every write."""
    server, engine = unprobed, unprobed.engine
    body = json.dumps({"model": "mock", "prompt": "abc", "max_tokens": 200, "stream": True})
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
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

    async def drive() -> int:
        first_chunk, messages = asyncio.Event(), [{"type": "http.request", "body": body.encode()}]

        async def receive():
            if messages:
                return messages.pop()
            await first_chunk.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                first_chunk.set()

        task = asyncio.ensure_future(server.http_api.app(scope, receive, send))
        await first_chunk.wait()
        steps = engine.num_steps
        await asyncio.wait_for(task, 30)
        return steps

    _abort_within_a_step(server, asyncio.run(drive()))
