"""Regression tests for the serving defects of issue 17 item 6 (MockEngine, real gRPC):
auth and size limits on every RPC before any work, port refused when taken, expired queue
entries leaving at once, outcomes as the client sees them, slow consumers, malformed
messages, enum and token-id ranges, secrets kept out of the logs."""

import logging
import socket
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.client import GenerateClient, build_request
from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.frontend.request_state import SlowConsumerPolicy
from serving.frontend.tenants import TenantRegistry
from serving.proto import pagedjax_pb2 as pb
from serving.server import PagedJaxServer, PortInUseError, ServerConfig
from serving.testing import calls_seen, outcome_counts, running_server, wait_for

GENERATE = "/pagedjax.v1.PagedJax/Generate"
TOKENIZE = "/pagedjax.v1.PagedJax/Tokenize"
SECRET_KEY = "k-secret-acme-0123456789"


def _locked_registry() -> TenantRegistry:
    return TenantRegistry.from_dict(
        {"tenants": [{"name": "acme", "api_keys": [SECRET_KEY]}], "allow_anonymous": False}
    )


def _raw_call(port: int, method: str, payload: bytes, metadata=(), stream: bool = False):
    """Sends raw bytes as the request message; returns (code, details)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        kwargs = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
        try:
            if stream:
                list(channel.unary_stream(method, **kwargs)(payload, metadata=metadata, timeout=10))
            else:
                channel.unary_unary(method, **kwargs)(payload, metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


class _CountingTokenizer:
    """Wraps the mock's tokenizer, counting the bytes it was asked to encode."""

    def __init__(self, inner):
        self.inner, self.encoded_bytes = inner, 0
        self.vocab_size, self.eos_token_ids = inner.vocab_size, inner.eos_token_ids

    def encode(self, text):
        self.encoded_bytes += len(text.encode())
        return self.inner.encode(text)

    def decode(self, ids):
        return self.inner.decode(ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.inner.apply_chat_template(messages, add_generation_prompt)


# ---- authentication before any work -------------------------------------------------------
def test_every_rpc_needs_a_valid_key_and_the_message_is_not_parsed_without_one(caplog):
    caplog.set_level(logging.INFO)
    engine = MockEngine(step_time_s=0.001)
    engine.tokenizer = _CountingTokenizer(engine.tokenizer)
    with running_server(engine, tenants=_locked_registry()) as (server, anonymous):
        port = server.port
        with GenerateClient(f"127.0.0.1:{port}", api_key="wrong-key") as wrong:
            for client in (anonymous, wrong):
                with pytest.raises(grpc.RpcError) as info:
                    client.tokenize("hello")
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                for rpc in (client.server_info, client.list_models):
                    with pytest.raises(grpc.RpcError) as info:
                        rpc()
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.generate("abc", max_tokens=2).code == "UNAUTHENTICATED"
        # a garbage Generate message with a bad key is refused as unauthenticated: not parsed
        code, _ = _raw_call(port, GENERATE, b"\xff" * 64, [("x-api-key", "nope")], stream=True)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert engine.tokenizer.encoded_bytes == 0
        with GenerateClient(f"127.0.0.1:{port}", api_key=SECRET_KEY) as good:
            assert good.tokenize("hi") == [104, 105]
            assert good.server_info().limits.max_prompt_tokens > 0
            assert good.generate("abc", max_tokens=2).ok
        # health probes need no key
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest()).status == 1
        wait_for(lambda: sum(outcome_counts(server).values()) == calls_seen(server))
        assert outcome_counts(server)[("rejected", "unauthenticated")] == 3
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert SECRET_KEY not in logged and "wrong-key" not in logged


def test_keys_are_stored_as_digests_only():
    registry = _locked_registry()
    assert SECRET_KEY not in repr(vars(registry))
    assert registry.authenticate(SECRET_KEY).name == "acme"


# ---- sizes bounded before tokenizing -------------------------------------------------------
def test_prompt_bytes_are_bounded_before_tokenizing():
    engine = MockEngine(step_time_s=0.001, max_model_len=2048)
    engine.tokenizer = _CountingTokenizer(engine.tokenizer)
    admission = AdmissionConfig(max_prompt_bytes=1000, max_chat_messages=4)
    with running_server(engine, admission=admission) as (server, client):
        res = client.generate("x" * 1001, max_tokens=2)
        assert res.code == "INVALID_ARGUMENT" and "text" in res.details and "1000" in res.details
        res = client.generate(messages=[{"role": "user", "content": "é" * 501}], max_tokens=2)
        assert res.code == "INVALID_ARGUMENT" and "1000 bytes" in res.details
        res = client.generate(messages=[{"role": "user", "content": "a"}] * 5, max_tokens=2)
        assert res.code == "INVALID_ARGUMENT" and "chat.messages" in res.details
        with pytest.raises(grpc.RpcError) as info:
            client.tokenize("y" * 1001)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert engine.tokenizer.encoded_bytes == 0  # nothing was tokenized
        assert client.generate("x" * 1000, max_tokens=2).ok


def test_request_message_size_limit():
    with running_server(max_request_bytes=10_000) as (server, client):
        res = client.generate("a" * 15_000, max_tokens=2)  # under gRPC core's 2x bound
        assert res.code == "INVALID_ARGUMENT"
        assert "bytes" in res.details and "10000" in res.details
        res = client.generate("a" * 30_000, max_tokens=2)  # refused by gRPC core itself
        assert res.code == "RESOURCE_EXHAUSTED"
        assert client.generate("abc", max_tokens=2).ok
        wait_for(lambda: sum(outcome_counts(server).values()) == calls_seen(server))


# ---- malformed messages and value ranges ---------------------------------------------------
def test_malformed_message_is_invalid_argument_with_one_log_line(caplog):
    caplog.set_level(logging.INFO)
    with running_server() as (server, client):
        code, details = _raw_call(server.port, GENERATE, b"\xff\xff\xff\xff", stream=True)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details
        code, _ = _raw_call(server.port, TOKENIZE, b"\x0a\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.generate("abc", max_tokens=2).ok
        wait_for(lambda: outcome_counts(server).get(("rejected", "invalid_argument")) == 1)
    refused = [r for r in caplog.records if "not a valid protobuf" in r.getMessage()]
    assert len(refused) == 2 and not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"priority": 99}, "priority"),
        ({"priority": -1}, "priority"),
        ({"stop_token_ids": [256]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [5, -1]}, "stop_token_ids[1]"),
        ({"token_ids": pb.TokenIds(ids=[1, 99999])}, "token_ids[1]"),
    ],
)
def test_enum_and_token_id_ranges(fields, field):
    with running_server() as (_, client):
        req = build_request("abc", max_tokens=2)
        for name, value in fields.items():
            if name == "token_ids":
                req.token_ids.CopyFrom(value)
            elif name == "stop_token_ids":
                req.stop_token_ids.extend(value)
            else:
                setattr(req, name, value)
        res = client.generate_request(req)
        assert res.code == "INVALID_ARGUMENT" and field in res.details, res.details


# ---- the port ------------------------------------------------------------------------------
def test_a_taken_port_is_refused():
    with running_server() as (server, _), pytest.raises(PortInUseError, match=str(server.port)):
        PagedJaxServer(MockEngine(), ServerConfig(host="127.0.0.1", port=server.port))


@pytest.mark.subprocess
def test_server_program_exits_with_a_message_when_the_port_is_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "serving.server", "--model=mock", "--host=127.0.0.1",
             f"--port={port}", "--metrics_port=-1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode != 0 and "serving on" not in proc.stdout
    # the flag check names the port; a bind that loses a race raises PortInUseError
    assert str(port) in proc.stderr and "in use" in proc.stderr


# ---- the queue -----------------------------------------------------------------------------
def test_expired_queue_entries_leave_when_they_expire():
    """The engine is stuck in a 3 s step; queued requests whose deadline or queue timeout
    passes must leave the queue within that step, not after it."""
    engine = MockEngine(step_time_s=3.0, max_num_seqs=1)
    admission = AdmissionConfig(queue_timeout_s=0.5, max_queue_requests=8)
    with running_server(engine, admission=admission, max_inflight=1, capacity_probe=False) as (
        server,
        client,
    ):
        target = f"127.0.0.1:{server.port}"
        results = []
        first = threading.Thread(target=lambda: client.generate("a", max_tokens=2))
        first.start()
        wait_for(lambda: engine.num_steps >= 1, what="the long step started")

        def call(timeout_s):
            with GenerateClient(target) as c:
                results.append(c.generate("b", max_tokens=2, timeout_s=timeout_s))

        threads = [threading.Thread(target=call, args=(t,)) for t in (0.3, 0.3, None, None)]
        for t in threads:
            t.start()
        wait_for(lambda: len(server.waiting) == 4 or engine.num_steps > 1, what="queued")
        steps_before = engine.num_steps
        wait_for(lambda: len(server.waiting) == 0, timeout_s=2.5, what="queue emptied")
        assert engine.num_steps == steps_before  # still inside the same long step
        for t in threads:
            t.join(10)
        first.join(10)
        counts = outcome_counts(server)
        assert counts[("timed_out", "deadline")] == 2
        assert counts[("rejected", "queue_timeout")] == 2
        assert sorted(r.code for r in results) == [
            "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"
        ]  # fmt: skip


# ---- outcomes as the client sees them ------------------------------------------------------
def test_client_deadline_is_timed_out_and_client_cancel_is_cancelled():
    engine = MockEngine(step_time_s=0.005, max_model_len=8000, num_pages=4096)
    admission = AdmissionConfig(max_tokens=5000, max_model_len=8000)
    # no capacity model: it would shed these at once (they cannot finish in time)
    with running_server(engine, admission=admission, capacity_probe=False) as (server, client):
        for i in range(3):
            res = client.generate("abc", max_tokens=4000, timeout_s=0.4, request_id=f"d{i}")
            assert res.code == "DEADLINE_EXCEEDED"
        for i, timeout_s in enumerate((None, 30.0)):
            call = client.stream(
                build_request("abc", max_tokens=4000, request_id=f"c{i}"), timeout_s
            )
            next(call)
            call.cancel()
        wait_for(lambda: sum(outcome_counts(server).values()) == 5, what="5 outcomes")
        counts = outcome_counts(server)
        assert counts[("timed_out", "deadline")] == 3
        assert counts[("cancelled", "client")] == 2
        wait_for(lambda: engine.stats()["kv_pages_used"] == 0, what="pages freed")


def test_success_is_recorded_only_once_the_final_message_was_sent():
    """The engine finishes while the client's transport is full and the client then goes
    away: the final message never left, so the outcome is cancelled{client}, not success."""
    engine = MockEngine(step_time_s=0.0005, max_model_len=8000, num_pages=4096)
    admission = AdmissionConfig(max_tokens=5000, max_model_len=8000)
    lenient = SlowConsumerPolicy(max_tokens_ahead=10**6, stall_timeout_s=1e6)
    with running_server(
        engine, admission=admission, slow_consumer=lenient, stream_buffer_messages=10**6
    ) as (server, _):
        tiny_window = GenerateClient(
            f"127.0.0.1:{server.port}",
            options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)],
        )
        call = tiny_window.stream(build_request("abc", max_tokens=3000, request_id="gone"))
        next(call)
        wait_for(
            lambda: engine.stats()["num_running"] == 0 and engine.num_steps >= 3000,
            timeout_s=60,
            what="the engine finished the request",
        )
        assert not outcome_counts(server)  # finished in the engine, final not yet sent
        call.cancel()
        wait_for(lambda: outcome_counts(server) == {("cancelled", "client"): 1.0})
        tiny_window.close()


def test_slow_consumer_is_aborted_by_tokens_ahead_and_pages_freed():
    engine = MockEngine(step_time_s=0.001, max_model_len=8000, num_pages=4096)
    admission = AdmissionConfig(max_tokens=5000, max_model_len=8000)
    policy = SlowConsumerPolicy(max_tokens_ahead=64, stall_timeout_s=60.0)
    with running_server(engine, admission=admission, slow_consumer=policy) as (server, client):
        slow = GenerateClient(
            f"127.0.0.1:{server.port}",
            options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)],
        )
        call = slow.stream(build_request("abc", max_tokens=5000, request_id="slow"))
        next(call)
        wait_for(lambda: outcome_counts(server).get(("cancelled", "slow_consumer")) == 1)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert "ahead of what the transport accepted" in info.value.details()
        wait_for(lambda: engine.stats()["kv_pages_used"] == 0, what="pages freed")
        assert engine.num_steps < 4000
        slow.close()


def test_slow_consumer_stall_timeout():
    engine = MockEngine(step_time_s=0.02, max_model_len=8000, num_pages=4096)
    admission = AdmissionConfig(max_tokens=5000, max_model_len=8000)
    policy = SlowConsumerPolicy(max_tokens_ahead=10**6, stall_timeout_s=0.5)
    with running_server(engine, admission=admission, slow_consumer=policy) as (server, client):
        slow = GenerateClient(
            f"127.0.0.1:{server.port}",
            options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)],
        )
        call = slow.stream(build_request("abc", max_tokens=5000, request_id="stall"))
        next(call)
        wait_for(lambda: outcome_counts(server).get(("cancelled", "slow_consumer")) == 1)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert "waited" in info.value.details() and "for the transport" in info.value.details()
        wait_for(lambda: engine.stats()["kv_pages_used"] == 0, what="pages freed")
        slow.close()


# ---- logs ----------------------------------------------------------------------------------
def test_prompt_text_is_not_logged(caplog):
    caplog.set_level(logging.DEBUG)
    marker = "PROMPT-MARKER-7731"
    with running_server() as (server, client):
        assert client.generate(marker, max_tokens=2).ok
        assert client.generate(marker, max_tokens=10**6).code == "INVALID_ARGUMENT"
        wait_for(lambda: sum(outcome_counts(server).values()) == 2)
    assert any("request_end" in r.getMessage() for r in caplog.records)
    assert not any(marker in r.getMessage() for r in caplog.records)


def test_every_call_in_a_hostile_mix_has_one_outcome():
    with running_server(tenants=_locked_registry(), api_key=SECRET_KEY) as (server, client):
        port = server.port
        _raw_call(port, GENERATE, b"\x00\xff", [("x-api-key", SECRET_KEY)], stream=True)
        _raw_call(port, GENERATE, b"junk", stream=True)
        assert client.generate("abc", max_tokens=2).ok
        assert client.generate("abc", max_tokens=2, stop_token_ids=[999]).code == (
            "INVALID_ARGUMENT"
        )
        wait_for(lambda: sum(outcome_counts(server).values()) == calls_seen(server) == 4)
        counts = outcome_counts(server)
        assert counts[("rejected", "invalid_argument")] == 2
        assert counts[("rejected", "unauthenticated")] == 1
        assert counts[("success", "")] == 1


# ---- faults --------------------------------------------------------------------------------
def test_a_failed_step_fails_only_its_requests():
    """2 slots, 4 calls: the 2 in the failing step end INTERNAL, the 2 queued ones finish."""
    engine = MockEngine(step_time_s=0.02, max_num_seqs=2)
    with running_server(engine, max_inflight=2, capacity_probe=False) as (server, client):
        results = {}

        def call(i):
            results[i] = client.generate("abc", max_tokens=20, request_id=f"f{i}")

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: engine.stats()["num_running"] == 2 and len(server.waiting) == 2)
        engine.fail_next_steps(1)
        for t in threads:
            t.join(30)
        codes = sorted(r.code for r in results.values())
        assert codes == ["INTERNAL", "INTERNAL", "OK", "OK"], codes
        assert all("engine step failed" in r.details for r in results.values() if not r.ok)
        assert server.breaker.state == "closed"  # one failure is below the threshold
        assert outcome_counts(server) == {("failed", "engine_step"): 2.0, ("success", ""): 2.0}
