"""Helpers for tests and demos: a real server on an ephemeral localhost port."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

from serving.client import GenerateClient
from serving.engine_host.mock_engine import MockEngine
from serving.frontend.admission import AdmissionConfig
from serving.frontend.tenants import TenantRegistry
from serving.server import PagedJaxServer, ServerConfig


def free_port() -> int:
    """A TCP port free on localhost now (another process may take it before you bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout_s: float) -> None:
    """Until the gRPC health check of `address` says SERVING (warm-up over)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not SERVING within {timeout_s}s")


@contextlib.contextmanager
def running_server(
    engine=None,
    *,
    tenants: TenantRegistry | None = None,
    admission: AdmissionConfig | None = None,
    api_key: str | None = None,
    warmup: Callable[[], None] | None = None,
    **config,
) -> Iterator[tuple[PagedJaxServer, GenerateClient]]:
    """Starts a server (MockEngine unless given) on 127.0.0.1:0 and a gRPC client for it;
    `http_port=0` also serves the HTTP API on an ephemeral port (`server.http_port`)."""
    engine = engine if engine is not None else MockEngine(step_time_s=0.002)
    cfg = ServerConfig(host="127.0.0.1", port=0, admission=admission or AdmissionConfig(), **config)
    server = PagedJaxServer(engine, cfg, tenants, warmup=warmup).start()
    client = GenerateClient(f"127.0.0.1:{server.port}", api_key=api_key)
    try:
        yield server, client
    finally:
        client.close()
        server.stop(0)


def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float = 10.0,
    what: str | Callable[[], str] = "condition",
) -> None:
    """Polls until predicate() holds; a generous timeout only guards against a hang.
    `what` (or what() when callable, for state at failure time) names the condition."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.005)


def outcome_counts(server: PagedJaxServer) -> dict[tuple[str, str], float]:
    """{(outcome, reason): count} read from the server's Prometheus registry."""
    counts = {}
    for metric in server.metrics.outcomes.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                counts[(s.labels["outcome"], s.labels["reason"])] = s.value
    return counts


def calls_seen(server: PagedJaxServer) -> float:
    """Generate calls that reached the server (pagedjax_generate_calls_total)."""
    return server.metrics.generate_calls._value.get()


class RealTokenizerMockEngine(MockEngine):
    """The mock engine with a real tokenizer (and its chat template and vocab size): the
    serving path from the transport's parser through the template, tokenization, admission
    and the scheduler is the production code; only the device step is the mock's."""

    def __init__(self, tokenizer, **kw):
        from engine.sched.outputs import OutputProcessor

        super().__init__(**kw)
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(self.scheduler, tokenizer, vocab_size=tokenizer.vocab_size)


def smollm2_tokenizer():
    """SmolLM2's tokenizer and chat template, rebuilt from its GGUF (no weights loaded)."""
    from models.loaders.gguf_tokenizer import tokenizer_from_gguf
    from models.registry import smollm2_gguf_path

    return tokenizer_from_gguf(smollm2_gguf_path())
