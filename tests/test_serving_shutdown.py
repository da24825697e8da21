"""Graceful shutdown (serving/frontend/shutdown.py): drain admitted work, refuse new work,
exit 0."""

import os
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.client import GenerateClient, build_request
from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.frontend.shutdown import drain
from serving.server import PagedJaxServer, ServerConfig
from serving.testing import calls_seen, outcome_counts, wait_for


def _server(engine, **config) -> PagedJaxServer:
    admission = AdmissionConfig(max_tokens=5000, max_model_len=8000)
    cfg = ServerConfig(host="127.0.0.1", port=0, admission=admission, **config)
    return PagedJaxServer(engine, cfg).start()


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status


def test_drain_finishes_admitted_requests_and_refuses_new_ones():
    engine = MockEngine(step_time_s=0.01, max_model_len=8000, num_pages=4096)
    server = _server(engine)
    client = GenerateClient(f"127.0.0.1:{server.port}")
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(client.generate("abc", max_tokens=60)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: server.loop.num_active() == 3, what="3 admitted")
    drainer = threading.Thread(target=drain, args=(server, 30.0))
    drainer.start()
    wait_for(lambda: server.generator.draining)
    assert _health(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    refused = client.generate("abc", max_tokens=2)
    assert refused.code == "UNAVAILABLE" and refused.retry_after_ms is not None
    for t in threads:
        t.join(30)
    drainer.join(30)
    assert [r.code for r in results] == ["OK"] * 3
    assert all(r.completion_tokens == 60 for r in results)
    counts = outcome_counts(server)
    assert counts == {("success", ""): 3.0, ("rejected", "draining"): 1.0}
    assert sum(counts.values()) == calls_seen(server)
    client.close()


def test_drain_timeout_cancels_the_rest_with_an_outcome_and_frees_pages():
    engine = MockEngine(step_time_s=0.01, max_model_len=8000, num_pages=4096)
    server = _server(engine)
    client = GenerateClient(f"127.0.0.1:{server.port}")
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(client.generate("abc", max_tokens=4000)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: engine.stats()["num_running"] == 2, what="both running")
    cut = drain(server, drain_timeout_s=0.3)
    for t in threads:
        t.join(30)
    assert cut == 2
    assert [r.code for r in results] == ["CANCELLED"] * 2
    assert all("shutting down" in r.details for r in results)
    assert outcome_counts(server) == {("cancelled", "shutdown"): 2.0}
    assert engine.stats()["kv_pages_used"] == 0
    client.close()


def _children(pid: int) -> list[int]:
    """Child processes of `pid` (Linux /proc)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.subprocess
@pytest.mark.parametrize("engine_flags", [[], ["--engine_process"]], ids=["in_process", "child"])
def test_sigterm_drains_the_server_program_and_exits_0(engine_flags):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.server", "--model=mock", "--host=127.0.0.1",
         "--port=0", "--metrics_port=-1", "--mock_step_time_s=0.01", "--drain_timeout_s=30",
         *engine_flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving on"), (line, proc.stderr.read() if proc.poll() else "")
        port = int(line.split()[2])  # "serving on PORT (metrics port ...)"
        children = _children(proc.pid)
        if engine_flags:
            assert children  # the engine process (and spawn's resource tracker)
        with GenerateClient(f"127.0.0.1:{port}") as client:
            call = client.stream(build_request("abc", max_tokens=100, request_id="inflight"))
            first = next(call)
            proc.send_signal(signal.SIGTERM)
            tokens = list(first.token_ids)
            final = None
            for msg in call:
                tokens.extend(msg.token_ids)
                final = msg.final if msg.HasField("final") else final
            assert len(tokens) == 100 and final.finish_reason == "length"
        assert proc.wait(60) == 0
        wait_for(lambda: not any(map(_running, children)), 20.0, "child processes gone")
    finally:
        if proc.poll() is None:
            proc.kill()


def _recording(engine):
    """Records the request ids the engine was given."""
    engine.seen, add = [], engine.add_request

    def add_request(request):
        engine.seen.append(request.request_id)
        add(request)

    engine.add_request = add_request
    return engine


def test_reload_under_load_fails_nothing_and_names_the_revision():
    from serving.engine_host.mock_engine import MockIdentity

    old = _recording(MockEngine(step_time_s=0.01, max_num_seqs=4, num_pages=1024))
    new = _recording(
        MockEngine(
            step_time_s=0.01,
            max_num_seqs=4,
            num_pages=1024,
            identity=MockIdentity(revision="mock-rev-2"),
        )
    )
    server = _server(old, max_inflight=4)
    client = GenerateClient(f"127.0.0.1:{server.port}")
    results = {}

    def call(i):
        results[f"r{i}"] = client.generate("abc", max_tokens=40, request_id=f"r{i}")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    wait_for(lambda: len(old.seen) >= 4, what="the old engine busy")
    assert server.reload(new, timeout_s=30)
    for t in threads:
        t.join(30)
    assert all(r.ok for r in results.values()), {k: r.code for k, r in results.items()}
    assert old.seen and new.seen and set(old.seen).isdisjoint(new.seen)
    for request_id, r in results.items():
        expected = "mock-rev-1" if request_id in old.seen else "mock-rev-2"
        assert r.versions["revision"] == expected
    after = client.generate("abc", max_tokens=2, revision="mock-rev-2")
    assert after.ok and after.versions["revision"] == "mock-rev-2"
    client.close()
    server.stop(0)


def test_reload_refuses_another_tokenizer():
    from serving.engine_host.mock_engine import MockIdentity

    server = _server(MockEngine(step_time_s=0.001))
    other = MockEngine(identity=MockIdentity(tokenizer_hash="other"))
    with pytest.raises(ValueError, match="tokenizer_hash"):
        server.reload(other)
    server.stop(0)


@pytest.mark.subprocess
def test_sigterm_during_warm_up_stops_it_and_exits_0(tmp_path):
    """A server told to stop while it compiles (a rollout replacing a starting pod) stops
    after the programs in flight instead of building the whole set: exit 0, one line
    saying so, no traceback, fewer programs than the set."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.server", "--model=tiny", "--host=127.0.0.1",
         "--port=0", "--metrics_port=-1", "--warmup_max_shapes=32",
         f"--compilation_cache_dir={tmp_path}/xla"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving on"):
                break
        assert lines and lines[-1].startswith("serving on"), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, rest
        assert "warm-up stopped: the server is shutting down" in rest, rest
        assert "Traceback" not in rest and "warm-up failed" not in rest, rest
        assert "32/32 step shapes compiled" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
