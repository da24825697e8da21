"""Overload behaviour end to end (real server on localhost, MockEngine): cancellation frees
pages within a step, bursts are rejected with a retry hint, slow readers are cut off without
holding back others, and the circuit breaker. Outcome counters are checked to add up."""

import json
import logging
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.client import GenerateClient, build_request
from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.testing import calls_seen, outcome_counts, running_server, wait_for


def _total(server):
    return sum(outcome_counts(server).values())


def test_client_cancel_frees_pages_within_a_step_and_others_continue():
    engine = MockEngine(page_size=4, num_pages=256, step_time_s=0.002)
    with running_server(engine) as (server, client):
        other = {}
        t = threading.Thread(
            target=lambda: other.update(
                res=client.generate("klm", max_tokens=80, request_id="other")
            )
        )
        t.start()
        call = client.stream(build_request("abc", max_tokens=400, request_id="victim"))
        received = ""
        for msg in call:
            received += msg.text
            if len(received) >= 5:
                break
        call.cancel()
        wait_for(lambda: any(rid == "victim" for rid, _, _ in engine.abort_log), what="abort")
        [(_, abort_step, freed_step)] = [e for e in engine.abort_log if e[0] == "victim"]
        assert freed_step - abort_step <= 1  # pages freed by the next step after the abort
        assert received == "defghijklmnopqrstuvwxyz"[: len(received)]
        t.join(30)
        assert other["res"].ok and other["res"].text == "".join(
            chr(32 + (ord("m") - 32 + k) % 95) for k in range(1, 81)
        )
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
        counts = outcome_counts(server)
        assert counts == {("cancelled", "client"): 1, ("success", ""): 1}


def test_burst_far_above_capacity_rejects_excess_with_retry_after(caplog):
    caplog.set_level(logging.INFO, logger="pagedjax.requests")
    engine = MockEngine(max_num_seqs=2, step_time_s=0.002)
    admission = AdmissionConfig(max_queue_requests=4)
    n = 40
    with running_server(engine, admission=admission, max_inflight=2) as (server, client):
        barrier = threading.Barrier(n)
        results = [None] * n

        def one(i):
            barrier.wait()
            results[i] = client.generate("abc", max_tokens=20, request_id=f"r{i}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ok = [r for r in results if r.ok]
        rejected = [r for r in results if r.code == "RESOURCE_EXHAUSTED"]
        assert len(ok) + len(rejected) == n, {r.code for r in results}
        assert len(ok) >= 6 and len(rejected) >= 1  # at least 2 running + 4 queued got in
        assert all(r.text == "defghijklmnopqrstuvw" for r in ok)
        assert all(r.retry_after_ms is not None and r.retry_after_ms > 0 for r in rejected)
        assert all("queue" in r.details for r in rejected)
        counts = outcome_counts(server)
        assert _total(server) == n == calls_seen(server)
        assert counts[("success", "")] == len(ok)
        assert counts.get(("rejected", "queue_full"), 0) == len(rejected)
        ends = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pagedjax.requests"]
        assert sorted(e["request_id"] for e in ends) == sorted(f"r{i}" for i in range(n))
        assert all(e["revision"] == "mock-rev-1" and "tenant" in e for e in ends)
        slowest_reject_ms = max(r.client_e2e_s for r in rejected) * 1e3
        print(
            f"burst of {n}: {len(ok)} admitted, {len(rejected)} rejected; "
            f"slowest rejection {slowest_reject_ms:.1f} ms (client side)"
        )


def test_slow_consumer_is_cancelled_and_does_not_hold_back_others():
    engine = MockEngine(step_time_s=0.001, num_pages=4096, max_model_len=8000)
    admission = AdmissionConfig(max_tokens=5000, max_model_len=8000)
    with running_server(engine, admission=admission, stream_buffer_messages=32) as (server, client):
        # A reader with a tiny HTTP/2 window, so that not reading stalls the server's sends.
        slow = GenerateClient(
            f"127.0.0.1:{server.port}",
            options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)],
        )
        call = slow.stream(build_request("abc", max_tokens=5000, request_id="slow"))
        next(call)  # then stop reading
        fast = client.generate("abc", max_tokens=60)  # runs while the slow one is stalled
        assert fast.ok and fast.completion_tokens == 60
        wait_for(
            lambda: outcome_counts(server).get(("cancelled", "slow_consumer")) == 1,
            what="slow consumer cancelled",
        )
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "too slowly" in info.value.details()
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
        assert engine.stats()["num_steps"] < 1000  # the slow request (5000 tokens) was cut off
        slow.close()
        assert _total(server) == 2


def test_circuit_breaker_opens_and_a_probe_closes_it():
    engine = MockEngine(step_time_s=0.001)
    with running_server(engine, breaker_failure_threshold=2, breaker_cooldown_s=1.0) as (
        server,
        client,
    ):
        health = health_pb2_grpc.HealthStub(client.channel)

        def serving_status():
            return health.Check(health_pb2.HealthCheckRequest()).status

        engine.fail_next_steps(2)
        first = client.generate("abc", max_tokens=5)
        second = client.generate("abc", max_tokens=5)
        assert (first.code, second.code) == ("INTERNAL", "INTERNAL")
        assert "engine step failed" in first.details
        rejected = client.generate("abc", max_tokens=5)
        assert rejected.code == "UNAVAILABLE" and 0 < rejected.retry_after_ms <= 1000
        assert client.server_info().circuit_breaker == "open"
        wait_for(
            lambda: serving_status() == health_pb2.HealthCheckResponse.NOT_SERVING,
            what="health NOT_SERVING while open",
        )
        wait_for(lambda: server.breaker.state == "half_open", what="cooldown")
        probe = client.generate("abc", max_tokens=5)
        assert probe.ok and probe.text == "defgh"
        assert server.breaker.state == "closed"
        wait_for(
            lambda: serving_status() == health_pb2.HealthCheckResponse.SERVING,
            what="health SERVING again",
        )
        assert client.generate("xyz", max_tokens=3).ok
        counts = outcome_counts(server)
        assert counts == {
            ("failed", "engine_step"): 2,
            ("rejected", "circuit_open"): 1,
            ("success", ""): 2,
        }


def test_priority_order_and_queue_timeout_through_the_server():
    engine = MockEngine(step_time_s=0.002)
    admission = AdmissionConfig(queue_timeout_s=5.0)
    with running_server(engine, admission=admission, max_inflight=1) as (server, client):
        done = []

        def run(name, **fields):
            res = client.generate("abc", **fields)
            done.append((name, res))

        blocker = threading.Thread(target=run, args=("blocker",), kwargs=dict(max_tokens=150))
        blocker.start()
        wait_for(lambda: server.loop.last_stats.get("num_running") == 1, what="blocker running")
        low = threading.Thread(target=run, args=("low",), kwargs=dict(max_tokens=5, priority="low"))
        low.start()
        wait_for(lambda: len(server.waiting) == 1, what="low queued")
        high = threading.Thread(
            target=run, args=("high",), kwargs=dict(max_tokens=5, priority="high")
        )
        high.start()
        for t in (blocker, low, high):
            t.join(30)
        assert [name for name, _ in done] == ["blocker", "high", "low"]
        assert all(res.ok for _, res in done)
    short = AdmissionConfig(queue_timeout_s=0.05)
    with running_server(MockEngine(step_time_s=0.002), admission=short, max_inflight=1) as (
        server,
        client,
    ):
        call = client.stream(build_request("abc", max_tokens=300))
        next(call)
        res = client.generate("abc", max_tokens=5)
        # expired in the queue, or shed at arrival when the capacity model already saw that
        # its wait would pass the queue timeout: rejected{queue_timeout} either way
        assert res.code == "RESOURCE_EXHAUSTED" and "queue" in res.details
        assert res.retry_after_ms is not None and res.retry_after_ms > 0
        call.cancel()
        wait_for(lambda: _total(server) == 2, what="both outcomes")
        assert outcome_counts(server) == {
            ("rejected", "queue_timeout"): 1,
            ("cancelled", "client"): 1,
        }


def test_mixed_traffic_every_call_has_exactly_one_outcome(caplog):
    """Normal, cancelled, deadline, invalid, wrong-revision, failing-step and burst calls at
    once: the outcome counter and the request log each count every call exactly once."""
    caplog.set_level(logging.INFO, logger="pagedjax.requests")
    engine = MockEngine(max_num_seqs=3, step_time_s=0.002)
    admission = AdmissionConfig(max_queue_requests=5, max_tokens=200)
    kinds = ["ok", "cancel", "deadline", "invalid", "revision", "ok", "cancel", "ok"] * 5
    with running_server(engine, admission=admission, max_inflight=3, dispatch_timeout_s=1.0) as (
        server,
        client,
    ):

        def one(i, kind):
            rid = f"m{i}"
            if kind == "cancel":
                call = client.stream(build_request("abc", max_tokens=150, request_id=rid))
                try:
                    next(call)
                except grpc.RpcError:
                    return  # rejected before any token: still one outcome
                call.cancel()
            elif kind == "deadline":
                client.generate("abc", max_tokens=150, timeout_s=0.05, request_id=rid)
            elif kind == "invalid":
                client.generate("abc", max_tokens=201, request_id=rid)
            elif kind == "revision":
                client.generate("abc", max_tokens=5, revision="nope", request_id=rid)
            else:
                client.generate("abc", max_tokens=30, request_id=rid)

        threads = [threading.Thread(target=one, args=(i, k)) for i, k in enumerate(kinds)]
        for t in threads:
            t.start()
        engine.fail_next_steps(1)  # one failed step somewhere in the middle
        for t in threads:
            t.join(60)
        # at rest, every call the server saw has exactly one outcome
        wait_for(
            lambda: (
                server.dispatch.num_pending() == 0
                and not server.loop._active
                and _total(server) == calls_seen(server)
            ),
            what=lambda: (
                f"all outcomes: {outcome_counts(server)}, seen "
                f"{calls_seen(server)}, pending {server.dispatch.num_pending()}, "
                f"active {list(server.loop._active)}"
            ),
        )
        # only a short-deadline call can die inside gRPC before the server sees it
        assert 0 <= len(kinds) - calls_seen(server) <= kinds.count("deadline")
        counts = outcome_counts(server)
        assert counts[("rejected", "invalid_argument")] == 5
        assert counts[("rejected", "model_mismatch")] == 5
        ends = [
            json.loads(r.getMessage())["request_id"]
            for r in caplog.records
            if r.name == "pagedjax.requests"
        ]
        assert len(ends) == calls_seen(server)
        # a call dropped before a handler ran is logged under a placeholder id
        unnamed = {f"m{i}" for i in range(len(kinds))} - set(ends)
        assert all(kinds[int(rid[1:])] in ("deadline", "cancel") for rid in unnamed)
        assert len(ends) - len(set(ends) & {f"m{i}" for i in range(len(kinds))}) == counts.get(
            ("cancelled", "before_dispatch"), 0
        )
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
