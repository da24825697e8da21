"""The engine in a child process (serving/engine_host/process.py), with the MockEngine built there:
same answers as in-process, bad requests named, a killed child fails only what it held (one
outcome each) and a fresh child serves the next call, and the child ends with the server."""

import os
import signal
import threading

import pytest

from engine.api_types import EngineRequest
from engine.errors import InvalidRequestError
from engine.sampling.params import SamplingParams
from serving.engine_host.mock_engine import expected_continuation
from serving.engine_host.process import EngineProcessError, ProcessEngine
from serving.testing import outcome_counts, running_server, wait_for

pytestmark = pytest.mark.subprocess

MOCK_OPTIONS = {"max_num_seqs": 8, "num_pages": 256, "page_size": 4, "max_num_batched_tokens": 512}


def _mock(step_time_s: float = 0.002) -> ProcessEngine:
    return ProcessEngine.start(
        "mock", MOCK_OPTIONS, build_kwargs={"mock_step_time_s": step_time_s}, reply_timeout_s=60
    )


def test_a_server_on_a_process_engine_answers_as_in_process():
    engine = _mock()
    pid = engine.pid
    with running_server(engine) as (server, client):
        results = [client.generate("abc", max_tokens=6, request_id=f"r{i}") for i in range(3)]
        for res in results:
            assert res.ok, res
            assert res.token_ids == expected_continuation(ord("c"), 6)
            assert res.text == "defghi"
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
        assert outcome_counts(server) == {("success", ""): 3.0}
    # the server's stop closed the child
    assert not engine.alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_warmup_with_execute_reaches_the_child():
    """--warmup_execute travels in the warm-up message; the mock has no programs to warm,
    so this checks the message the child parses and the state a restart sends again."""
    engine = _mock()
    try:
        engine.warmup(4, execute=True)
        assert (engine._warm_shapes, engine._warm_execute) == (4, True)
        engine.add_request(EngineRequest("a", [65], SamplingParams(max_tokens=2)))
        while engine.has_unfinished():
            engine.step()
        assert engine.stats()["kv_pages_used"] == 0
    finally:
        engine.close()


def test_an_invalid_request_is_refused_in_the_child_and_named_in_the_parent():
    engine = _mock()
    try:
        bad = EngineRequest("bad", [65, 300], SamplingParams(max_tokens=2))  # vocab is 256
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(bad)
        assert "prompt" in str(info.value) and "300" in str(info.value)
        engine.add_request(EngineRequest("good", [65], SamplingParams(max_tokens=2)))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        assert [o.new_token_ids for o in outputs if o.request_id == "good"][-1]
        assert engine.stats()["kv_pages_used"] == 0
    finally:
        engine.close()


def test_an_injected_failed_step_fails_only_its_requests_across_the_pipe():
    engine = _mock(step_time_s=0.0)
    with running_server(engine) as (server, client):
        engine.call("fail_next_steps", 1)
        failed = client.generate("abc", max_tokens=4)
        assert failed.code == "INTERNAL", failed
        assert client.generate("abc", max_tokens=4).ok


def test_a_killed_engine_process_fails_what_it_held_once_and_a_new_one_serves():
    engine = _mock(step_time_s=0.05)
    first_pid = engine.pid
    with running_server(engine) as (server, client):
        results = {}

        def call(i):
            results[i] = client.generate("abc", max_tokens=200, request_id=f"long-{i}")

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: server.loop.num_active() == 3, what="three requests running")
        wait_for(lambda: all(r.token_times_s for r in server.loop.active_requests()))
        os.kill(first_pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert {r.code for r in results.values()} == {"INTERNAL"}, results
        assert all("engine process died" in r.details for r in results.values())
        assert outcome_counts(server) == {("failed", "engine_step"): 3.0}
        # the next call starts a fresh child, which serves it
        res = client.generate("abc", max_tokens=5, timeout_s=60)
        assert res.ok and res.text == "defgh", res
        assert engine.num_restarts == 1 and engine.pid != first_pid
        assert server.loop.num_active() == 0
        counts = outcome_counts(server)
        assert counts == {("failed", "engine_step"): 3.0, ("success", ""): 1.0}, counts
    assert not engine.alive


def test_a_child_that_cannot_build_its_engine_says_why():
    with pytest.raises(EngineProcessError, match="the mock engine allows"):
        ProcessEngine.start("mock", {**MOCK_OPTIONS, "quantization": "int8"})


def test_close_does_not_wait_for_a_call_in_flight():
    """SIGTERM during a long warm-up must not hang: close() kills the busy child (the pipe
    is held by the call waiting for its reply), and no new child is started afterwards."""
    engine = _mock()
    closer = threading.Thread(target=engine.close)
    with engine._lock:  # as a call waiting for its reply holds it
        closer.start()
        closer.join(30)
    assert not closer.is_alive() and not engine.alive
    with pytest.raises(EngineProcessError, match="closed"):
        engine.stats()
