"""HTTP outcomes recorded at delivery (serving/http/delivery.py, issue 17 item 6): success
only once the last byte went to a connection the client had not left; a client that leaves
after the engine finished but before its response was written is cancelled{client}; a
reader that keeps up is never taken for a slow consumer, however long the answer."""

import asyncio
import json

import httpx

from serving.engine_host.mock_engine import MockEngine, expected_continuation
from serving.frontend.admission import AdmissionConfig
from serving.frontend.request_state import SlowConsumerPolicy
from serving.testing import outcome_counts, running_server, wait_for

PATIENT = dict(  # nothing trips the slow-consumer policy in these tests
    http_port=0,
    stream_buffer_messages=100_000,
    slow_consumer=SlowConsumerPolicy(max_tokens_ahead=100_000, stall_timeout_s=1000.0),
)


def _scope(path: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # as uvicorn 0.54 says
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


async def _leave_after_the_engine_finished(server, body: dict, block_on: str) -> list:
    """Drives the ASGI app as a client whose transport takes nothing once `block_on`
    ("body": the first body chunk, "start": the response start) is sent: waits until the
    engine finished the request, checks that no outcome is recorded yet, then disconnects."""
    sent, stuck, leave, release = [], asyncio.Event(), asyncio.Event(), asyncio.Event()
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        kind = "http.response.start" if block_on == "start" else "http.response.body"
        if message["type"] == kind and (block_on == "start" or message.get("body")):
            stuck.set()
            await release.wait()  # the transport takes nothing until the client has left

    task = asyncio.ensure_future(server.http_api.app(_scope("/v1/completions"), receive, send))
    await stuck.wait()
    await asyncio.to_thread(
        wait_for, lambda: server.loop.num_active() == 0, 10.0, "engine finished the request"
    )
    assert outcome_counts(server) == {}, "recorded before the response was delivered"
    leave.set()
    await asyncio.sleep(0.05)
    release.set()  # uvicorn's send returns (ignored) once the client is gone
    await asyncio.wait_for(task, 10)
    return sent


def test_streamed_response_not_delivered_is_cancelled_not_success():
    engine = MockEngine(step_time_s=0.001)
    with running_server(engine, **PATIENT) as (server, _):
        body = {"model": "mock", "prompt": "abc", "max_tokens": 40, "stream": True}
        asyncio.run(_leave_after_the_engine_finished(server, body, block_on="body"))
        wait_for(lambda: outcome_counts(server) == {("cancelled", "client"): 1})
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")


def test_non_streamed_response_not_delivered_is_cancelled_not_success():
    engine = MockEngine(step_time_s=0.001)
    with running_server(engine, **PATIENT) as (server, _):
        body = {"model": "mock", "prompt": "abc", "max_tokens": 40}
        asyncio.run(_leave_after_the_engine_finished(server, body, block_on="start"))
        wait_for(lambda: outcome_counts(server) == {("cancelled", "client"): 1})


def test_delivered_responses_are_one_success_each():
    engine = MockEngine(step_time_s=0.001)
    with running_server(engine, http_port=0) as (server, _):
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        body = {"model": "mock", "prompt": "abc", "max_tokens": 8}
        assert httpx.post(url, json=body).json()["choices"][0]["text"] == "defghijk"
        with httpx.stream("POST", url, json={**body, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        wait_for(lambda: outcome_counts(server) == {("success", ""): 2})


def test_a_streamed_reader_that_keeps_up_is_not_a_slow_consumer():
    """The relay tells the policy what uvicorn took, so 300 tokens (more than
    max_tokens_ahead) stream to a reader that keeps up; before, every HTTP answer past 256
    tokens was cut as a slow consumer."""
    engine = MockEngine(step_time_s=0.002, max_model_len=512, num_pages=256)
    policy = SlowConsumerPolicy(max_tokens_ahead=64)
    admission = AdmissionConfig(max_tokens=400)
    with running_server(engine, admission=admission, http_port=0, slow_consumer=policy) as (
        server,
        _,
    ):
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        body = {"model": "mock", "prompt": "a", "max_tokens": 300, "stream": True}
        text = ""
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == "".join(map(chr, expected_continuation(ord("a"), 300)))
        wait_for(lambda: outcome_counts(server) == {("success", ""): 1})
