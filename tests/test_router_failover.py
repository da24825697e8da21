"""Router failure paths, in-process over MockEngine replicas (no JAX, a few seconds):
a replica that dies is taken out of routing and the requests it held without having sent a
message (queued there) are retried elsewhere exactly once, while a stream it had started
ends UNAVAILABLE (never a duplicate stream); `dns:NAME:PORT` workers resolve and re-resolve;
a worker of another revision than the pinned one is refused."""

import socket
import threading
import types

import grpc

from serving.client import GenerateClient, build_request
from serving.engine_host.mock_engine import MockEngine
from serving.router import workers as router_workers
from serving.router.server import Router
from serving.router.workers import WorkerPool, resolve
from serving.testing import calls_seen, running_server, wait_for


def mock_replica(**config):
    return running_server(MockEngine(step_time_s=0.01), capacity_probe=False, **config)


def prompts_routed_to(router: Router, address: str, count: int) -> list[str]:
    client = router.service.client
    found = [f"prompt {i}" for i in range(200)]
    found = [p for p in found if client.pick(build_request(p)).prefill == address]
    assert len(found) >= count, f"fewer than {count} of 200 prompts hash to {address}"
    return found[:count]


def stream_in_thread(address: str, prompt: str, results: dict) -> threading.Thread:
    """Streams `prompt` through the router; results[prompt] = ("ok", tokens) or the code."""

    def run():
        with GenerateClient(address) as client:
            request = build_request(prompt, max_tokens=200, stream=True, ignore_eos=True)
            try:
                tokens = sum(len(m.token_ids) for m in client.stream(request))
                results[prompt] = ("ok", tokens)
            except grpc.RpcError as e:
                results[prompt] = (e.code(), e.details())

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_dead_replica_leaves_routing_and_its_queued_request_is_retried_once():
    with (
        mock_replica(max_inflight=1) as (a, _),  # one request at a time: the next one queues
        mock_replica() as (b, _),
    ):
        addr_a, addr_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
        router = Router([addr_a, addr_b], health_interval_s=60).start()  # no re-check here
        try:
            streaming, queued = prompts_routed_to(router, addr_a, 2)
            results, target = {}, f"127.0.0.1:{router.port}"
            first = stream_in_thread(target, streaming, results)
            wait_for(lambda: a.loop.engine.num_steps > 3, 10, "A streaming")
            second = stream_in_thread(target, queued, results)
            wait_for(lambda: len(a.waiting) == 1, 10, "the second request queued on A")
            b_calls = calls_seen(b)
            a.grpc_server.stop(0)  # A dies: both of its calls end UNAVAILABLE
            first.join(30)
            second.join(30)
            assert results[streaming][0] == grpc.StatusCode.UNAVAILABLE  # had sent: no retry
            assert results[queued] == ("ok", 200)  # retried on B
            assert calls_seen(b) == b_calls + 1  # once: the queued request, not the stream
            assert router.service.counters["retried"] == 1
            assert not router.pool.is_routable(addr_a) and router.pool.is_routable(addr_b)
            with GenerateClient(target) as client:  # new requests go to B only
                assert client.generate(streaming, max_tokens=3).ok
            assert calls_seen(b) == b_calls + 2
        finally:
            router.stop(0)


def test_a_request_is_tried_at_most_twice_then_unavailable():
    with mock_replica() as (a, _), mock_replica() as (b, _):
        router = Router([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], health_interval_s=60)
        router.start()
        try:
            a.grpc_server.stop(0)
            b.grpc_server.stop(0)
            with GenerateClient(f"127.0.0.1:{router.port}") as client:
                res = client.generate("abc", max_tokens=3)
                assert res.code == grpc.StatusCode.UNAVAILABLE.name, res.code
                assert router.service.counters["retried"] == 1  # one retry, not more
                res = client.generate("abc", max_tokens=3)  # both are marked down now
                assert res.code == grpc.StatusCode.UNAVAILABLE.name
                assert "no routable worker" in res.details and res.retry_after_ms == 1000
            assert router.service.counters["retried"] == 1
        finally:
            router.stop(0)


def test_dns_worker_names_resolve_to_every_address():
    with mock_replica() as (server, _):
        found = resolve(f"dns:localhost:{server.port}")
        assert f"127.0.0.1:{server.port}" in found
        assert all(a.endswith(f":{server.port}") for a in found)
        assert resolve(f"dns:no-such-host.invalid:{server.port}") == []
        pool = WorkerPool([f"dns:localhost:{server.port}"], interval_s=60).start()
        try:
            assert pool.is_routable(f"127.0.0.1:{server.port}")
        finally:
            pool.stop()


def test_dns_workers_are_re_resolved_every_round(monkeypatch):
    answers = {"workers.test": ["127.0.0.1"]}

    def getaddrinfo(host, port, type=0):  # noqa: A002 - socket.getaddrinfo's own name
        if host not in answers:
            raise socket.gaierror(host)
        return [(socket.AF_INET, type, 6, "", (h, port)) for h in answers[host]]

    fake = types.SimpleNamespace(
        getaddrinfo=getaddrinfo, gaierror=socket.gaierror, SOCK_STREAM=socket.SOCK_STREAM
    )
    monkeypatch.setattr(router_workers, "socket", fake)
    with mock_replica() as (server, _):
        port = server.port
        pool = WorkerPool([f"dns:workers.test:{port}"], interval_s=60).start()
        try:
            assert list(pool.workers) == [f"127.0.0.1:{port}"]
            assert pool.acquire(f"127.0.0.1:{port}")  # one request in flight there
            answers["workers.test"] = ["127.0.0.2", "::1"]
            pool.check_all()  # the gone address stays while its request runs
            assert set(pool.workers) == {f"127.0.0.1:{port}", f"127.0.0.2:{port}", f"[::1]:{port}"}
            pool.release(f"127.0.0.1:{port}")
            pool.check_all()
            assert set(pool.workers) == {f"127.0.0.2:{port}", f"[::1]:{port}"}
            del answers["workers.test"]  # the name stops resolving: no worker, no crash
            pool.check_all()
            assert pool.workers == {}
        finally:
            pool.stop()


def test_a_worker_of_another_revision_than_the_pinned_one_is_refused():
    with mock_replica() as (server, _):
        router = Router([f"127.0.0.1:{server.port}"], revision="sha256:pinned").start()
        try:
            worker = router.pool.workers[f"127.0.0.1:{server.port}"]
            assert worker.healthy and "revision='mock-rev-1'" in worker.refused
            assert not router.service.has_route()
            with GenerateClient(f"127.0.0.1:{router.port}") as client:
                res = client.generate("abc", max_tokens=3)
            assert res.code == grpc.StatusCode.UNAVAILABLE.name
            assert calls_seen(server) == 0  # nothing reached the refused worker
        finally:
            router.stop(0)
